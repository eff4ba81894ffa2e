"""Copies of the user's model that autofit can run without touching the original.

The fake copy shares no storage with the original and allocates nothing: ``copy.deepcopy`` is handed a memo that
maps every parameter, buffer and tensor attribute to a fake tensor of the same shape, stride and dtype, so the copy's
structure, hooks and Python attributes are the user's own while its tensors live in a ``FakeTensorMode``. This works
the same for models on CPU, on CUDA and on the meta device (``with torch.device("meta"): model = ...``).

Note [training mode]
    ``from_pretrained`` returns a model in eval mode (transformers' ``PreTrainedModel.from_pretrained`` calls
    ``model.eval()``), and training loops put it in training mode later: Hugging Face's Trainer and Lightning call
    ``model.train()`` before their training steps, and so do the PyTorch tutorials' loops. A step simulated in the mode the model happened to be in when it was planned is an eval
    step: no dropout masks, BatchNorm on its running statistics, no LayerDrop; a tiny GPT-2 was planned 20 % below
    its real training step. So every copy autofit runs (simulated, traced, measured) is in the mode the training
    step runs in, the mode ``model.train()`` gives, when the model is in eval mode (``model.training`` is False):
    every module in training mode. A model in training mode keeps each module's own mode: a submodule the user put
    in eval mode on purpose (a frozen BatchNorm in a fine-tuned backbone) stays so, as it does in a loop that never
    calls ``model.train()`` again. The user's model keeps its mode; the estimate's and the plan's notes say when the
    step was simulated in another mode than the model's (``mode_note``). autofit's Trainer runs the model in the
    mode it finds it in, as a plain loop does (the distributed equivalence tests train in eval mode on purpose, to
    compare with a step without dropout), so the note asks for ``model.train()``: the training-mode step is also
    the larger of the two wherever the modes differ in memory (dropout keeps its mask, BatchNorm its batch
    statistics, LayerDrop runs every layer at worst), so a plan for it holds an eval-mode step too.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterator

import torch
from torch import nn

from autofit.core._torch import FakeTensorMode, compiled_modules, rewrap_compiled
from autofit.core.errors import UnsupportedModelError

__all__ = ["fake_copy", "fake_input", "real_copy", "module_tensor_attributes", "attached_tensors", "has_meta_tensors",
           "require_real_inputs", "shared_weights_copy", "trained_from_eval", "mode_note"]


def trained_from_eval(model: nn.Module) -> bool:
    """Whether the training step runs ``model`` in another mode than its own: it is in eval mode, and the step puts
    it in training mode (Note [training mode])."""
    return isinstance(model, nn.Module) and not model.training


def _as_trained(copied: nn.Module, model: nn.Module) -> nn.Module:
    """``copied`` in the mode the training step runs ``model`` in (Note [training mode])."""
    if trained_from_eval(model):
        copied.train()
    return copied


def mode_note(model: nn.Module) -> str:
    """The note of a step simulated in training mode for a model in eval mode (Note [training mode])."""
    return (f"the model ({type(model).__name__}) was in eval mode; the step was simulated in training mode, as a "
            "trainer runs it after model.train() (dropout, BatchNorm statistics and random layer skipping included; "
            "see Note [training mode]); your model was left in eval mode: call model.train() before training, "
            "autofit's trainer runs it in the mode it finds it in")


def module_tensor_attributes(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Plain tensor attributes of modules that are neither parameters nor buffers (causal masks, rotary caches)."""
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield (f"{name}.{attr}" if name else attr), value


# Note [quantized parameters]
#     A quantized layer keeps part of its weight outside the parameter's storage: bitsandbytes' ``Params4bit`` holds
#     a ``quant_state`` (absmax per block of 64 values, and with double quantization an 8-bit absmax plus a second
#     level of fp32 absmax, its code book and offset; bitsandbytes/functional.py, ``QuantState``), and its
#     ``Linear4bit`` keeps the same object as ``module.quant_state``; ``Int8Params`` holds ``CB`` (the int8 weight,
#     the parameter's own storage) and ``SCB`` (fp32 row scales), which ``Linear8bitLt`` moves into its
#     ``MatmulLtState`` (``module.state``) on the first forward. These tensors are memory of the parameter, so
#     ``attached_tensors`` finds them (attributes of a parameter, and of the plain objects a module holds, two
#     levels deep) and estimate and measure count them with the parameters. The fake copy keeps them: each becomes
#     a fake tensor (a view of its parameter's fake storage where it shares the parameter's storage, as ``CB``
#     does), and the parameter's attributes are copied onto its fake twin through the same memo, so the copy's
#     ``weight.quant_state`` is the copy's ``module.quant_state`` and holds fake tensors. The fake twin is a plain
#     parameter, not a ``Params4bit`` (a tensor subclass cannot wrap a FakeTensor); the layers read only its
#     attributes. ``Params4bit.__deepcopy__`` copies its ``quant_state`` without the memo, so in a real copy the
#     module's ``quant_state`` would be a second copy: it is linked back to the parameter's (``_relink_attributes``).
_ATTACHED_DEPTH = 2  # Params4bit.quant_state.state2.absmax: attribute of an attribute of the parameter's object


def attached_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors held in the attributes of parameters and of plain objects on modules: the quantization statistics
    of quantized layers (see Note [quantized parameters]). Private (``_``-prefixed) module attributes, modules and
    containers are not searched."""
    seen: set[int] = set()
    for name, p in model.named_parameters():
        yield from _object_tensors(name, p, 0, seen)
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr.startswith("_") or isinstance(value, (torch.Tensor, nn.Module)) or not _plain_object(value):
                continue
            yield from _object_tensors(f"{name}.{attr}" if name else attr, value, 1, seen)


def _plain_object(value: object) -> bool:
    return hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType, types.FunctionType,
                                                                 types.MethodType, nn.Module))


def _object_tensors(name: str, obj: object, depth: int, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for attr, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen.add(id(value))
                yield f"{name}.{attr}", value
        elif depth < _ATTACHED_DEPTH and _plain_object(value):
            yield from _object_tensors(f"{name}.{attr}", value, depth + 1, seen)


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def _fake_like(t: torch.Tensor, device: str) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device=device)


def fake_input(fake_mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake CPU twin of an input tensor (inputs on the meta device or a GPU included); call inside ``fake_mode``."""
    if t.is_meta:
        return _fake_like(t, "cpu")
    return fake_mode.from_tensor(t.detach().cpu() if t.device.type != "cpu" else t)


def require_real_inputs(*inputs: object, reader: str = "the step reads tensor values") -> None:
    """An :class:`UnsupportedModelError` when a step that must run for real (``reader`` says what reads values) is
    given inputs on the meta device, which hold no values to read; ``inputs``: Batches (or None)."""
    meta = [t for b in inputs if b is not None for t in b.tensors() if t.is_meta]
    if meta:
        raise UnsupportedModelError(
            f"{reader}, so autofit must run the step for real, but the sample (or target) has {len(meta)} tensor(s) "
            "on the meta device, which hold no values to read: give a real sample of the same shapes (rows of your "
            "data, or torch.randn / torch.randint on the CPU; a few rows do, autofit resizes them), and real weights"
        )


def require_quantized(model: nn.Module) -> None:
    """A bitsandbytes 4-bit weight that was never quantized (``quant_state`` None: a ``Linear4bit`` made on the meta
    device, or not yet moved to the GPU) cannot run its forward; say what is missing before a simulated step fails
    inside bitsandbytes with a bare AssertionError."""
    for name, p in model.named_parameters():
        if type(p).__name__ == "Params4bit" and getattr(p, "quant_state", None) is None:
            raise UnsupportedModelError(
                f"parameter {name!r} is a bitsandbytes 4-bit weight that was never quantized (its quant_state is "
                "None: a Linear4bit built on the meta device, or not yet moved to the GPU, holds no packed weight "
                "and no statistics). Quantize it where it is, meta included: packed, state = "
                "bitsandbytes.functional.quantize_4bit(weight, blocksize=64, quant_type='nf4', "
                "compress_statistics=True), then Params4bit(packed, quant_state=state, bnb_quantized=True, "
                "quant_type='nf4', module=layer); or build the model with autofit.hf_model(NAME, lora=RANK, "
                "qlora=True) (on the command line: hf:NAME --lora RANK --qlora), which does that")


def fake_copy(model: nn.Module, fake_mode: FakeTensorMode, *, device: str = "cpu") -> nn.Module:
    """A structural copy of ``model`` whose tensors are fake tensors on ``device`` (shape, stride, dtype kept)."""
    require_quantized(model)
    memo: dict[int, object] = {}
    storages: dict[int, tuple[object, torch.UntypedStorage]] = {}  # id(original storage) -> (it, its fake twin's)

    def twin(t: torch.Tensor, make) -> None:
        if id(t) in memo:
            return
        shared = storages.get(id(t.untyped_storage()))
        if shared is not None:  # a tensor on a storage already copied (Int8Params.CB): a view of the twin's
            fake = torch.empty(0, dtype=t.dtype, device=device).set_(shared[1], t.storage_offset(), t.shape,
                                                                      t.stride())
        else:
            fake = make(t)
        memo[id(t)] = fake
        storages.setdefault(id(t.untyped_storage()), (t.untyped_storage(), fake.untyped_storage()))

    with fake_mode:
        for p in model.parameters():
            twin(p, lambda p: nn.Parameter(_fake_like(p, device), requires_grad=p.requires_grad))
        for b in model.buffers():
            twin(b, lambda b: _fake_like(b, device))
        for _, t in module_tensor_attributes(model):
            twin(t, lambda t: _fake_like(t, device))
        for _, t in attached_tensors(model):  # Note [quantized parameters]
            twin(t, lambda t: _fake_like(t, device))
    try:
        result = _deepcopy(model, memo)
        _copy_parameter_attributes(model, memo)
        return _as_trained(result, model)
    except Exception as e:  # noqa: BLE001 - any deepcopy failure means the same thing to the user
        raise UnsupportedModelError(
            f"autofit could not copy the model ({type(e).__name__}: {e}); it copies the module tree to simulate "
            "without touching your model: make sure copy.deepcopy works on it"
        ) from e


def _copy_parameter_attributes(model: nn.Module, memo: dict[int, object]) -> None:
    """The Python attributes of each parameter (``quant_state``, ``CB``, ...) on its fake twin, deep-copied through
    the model's memo, so that they reach the copy's modules and fake tensors (Note [quantized parameters])."""
    for p in model.parameters():
        fake = memo[id(p)]
        for key, value in vars(p).items():
            if key not in vars(fake):
                fake.__dict__[key] = copy.deepcopy(value, memo)


def real_copy(model: nn.Module) -> nn.Module:
    """A deep copy with real weights, for steps that must really run (``measure``, data-dependent models)."""
    if has_meta_tensors(model):
        raise UnsupportedModelError(
            "this needs real weights, but the model has tensors on the meta device: build it on the CPU "
            "(or call model.to_empty(device='cpu') and initialise it)"
        )
    result = _deepcopy(model, {})
    _relink_attributes(model, result)
    return _as_trained(result, model)


def shared_weights_copy(model: nn.Module, *others: object) -> tuple[object, ...]:
    """A copy of ``model`` whose parameters read the original's storage (no second copy of the weights, on whatever
    device they are) and whose buffers, tensor attributes and Python state are its own; ``others`` (a loss that is a
    module or a bound method of the model) are copied through the same memo, so that they reach the copy. For
    forwards that only read the weights: a caller that runs it must refuse writes into them (the copy's parameters
    are other ``Parameter`` objects, but on the same storage). Returns ``(copy, *copies of others)``."""
    memo: dict[int, object] = {id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad)
                               for p in model.parameters()}
    result = _deepcopy(model, memo)
    _relink_attributes(model, result)
    return (result, *(copy.deepcopy(other, memo) for other in others))


def _relink_attributes(model: nn.Module, result: nn.Module) -> None:
    """A module attribute that is the very object one of the module's parameters holds (``Linear4bit.quant_state``
    is ``weight.quant_state``) stays that object in the copy, whatever the parameter's ``__deepcopy__`` did
    (Note [quantized parameters])."""
    for (_, module), (_, copied) in zip(model.named_modules(), result.named_modules()):
        params = [(p, c) for (_, p), (_, c) in zip(module.named_parameters(recurse=False),
                                                   copied.named_parameters(recurse=False))]
        for attr, value in vars(module).items():
            if attr.startswith("_") or isinstance(value, torch.Tensor) or not _plain_object(value):
                continue
            for p, c in params:
                key = next((k for k, v in vars(p).items() if v is value), None)
                if key is not None and key in vars(c):
                    copied.__dict__[attr] = vars(c)[key]
                    break


def _deepcopy(model: nn.Module, memo: dict[int, object]) -> nn.Module:
    """``copy.deepcopy``, plus the functions stored on the modules themselves (see Note [copied closures])."""
    result = copy.deepcopy(model, memo)
    for module in result.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and value.__closure__:
                module.__dict__[key] = _copy_closure(value, memo)
    for _, module in compiled_modules(result):  # Note [compiled models]
        rewrap_compiled(module)
    return result


# Note [compiled models]
#     ``torch.compile(model)`` returns an ``OptimizedModule`` whose ``forward`` (an instance attribute) is built
#     around the wrapped module's ``__call__`` (torch/_dynamo/eval_frame.py, ``OptimizedModule._initialize``).
#     A deep copy of it copies that function's closure apart from the copied ``_orig_mod``, so the copy's forward
#     ran a third copy of the module, whose parameters the optimizer does not hold: no gradient and no optimizer
#     state reached the counted parameters, in the simulation (54.9 MB for AdamW and SGD alike on a tiny Llama)
#     and in ``measure``. The copy's forward is rebuilt around the copy's ``_orig_mod``. A simulation then compiles
#     the fake copy with inductor, its kernels left out (Note [inductor without kernels], core/_torch_compile.py),
#     and a note says so; ``measure`` and the trainer run the compiled model for real.


# Note [copied closures]
#     copy.deepcopy returns functions as they are. A function the user stored on a module instance, typically a
#     wrapped forward (``orig = m.forward; m.forward = lambda *a, **k: orig(*a, **k)``), still closes over the
#     ORIGINAL module after the copy, so running the copy would run the user's module: real gradients and BatchNorm
#     statistics on the user's model, or fake gradients on it during a simulation. Such functions are rebuilt with
#     their closure cells deep-copied through the same memo, so they reach the copy's modules and tensors instead.
#     A cell that cannot be deep-copied keeps the original value (then that one object stays shared), and a captured
#     tensor that is not a parameter, buffer or tensor attribute is copied for real, even into the fake copy.
def _copy_closure(fn: types.FunctionType, memo: dict[int, object]) -> types.FunctionType:
    if id(fn) in memo:
        return memo[id(fn)]  # type: ignore[return-value]
    cells = tuple(types.CellType() for _ in fn.__closure__)
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    new.__kwdefaults__, new.__qualname__, new.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    new.__dict__.update(fn.__dict__)
    memo[id(fn)] = new
    memo.setdefault(id(memo), []).append(fn)  # keep fn alive while its id is a memo key, as deepcopy does
    for old_cell, cell in zip(fn.__closure__, cells):
        try:
            value = old_cell.cell_contents
        except ValueError:  # an empty cell (a variable not yet assigned in the enclosing scope)
            continue
        if isinstance(value, types.FunctionType) and value.__closure__:
            cell.cell_contents = _copy_closure(value, memo)
            continue
        try:
            cell.cell_contents = copy.deepcopy(value, memo)
        except Exception:  # noqa: BLE001 - see Note [copied closures]
            cell.cell_contents = value
    return new
