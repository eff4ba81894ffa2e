"""What makes a plan cheaper must not change it: worker processes (Note [parallel simulations]), the pruned search
(Note [pruned search]) and the rows-by-length guesses estimated up front.

The truths: the same computation run in this process (a forked worker is a copy of it, so the timelines must be
equal to the byte); the search without pruning (every micro-batch's MILP solved); hand-computed guesses.
"""

from __future__ import annotations

import os
import pickle
import threading
import time

import pytest
import torch

import autofit
from autofit.core import progress, workers
from autofit.analyse.analyse import analyse_model
from autofit.training.step import make_step_config
from autofit.core.errors import ForwardError
from autofit.parallel.layout import Parallel
from autofit.solve.space import analyse_policies as _analyse
from autofit.solve.space import search_space as _search_space
from autofit.options import Options
from autofit.request import make_request
from autofit.solve.lengths import first_guesses, rows_by_length
from autofit.solve.candidate import evaluate, batch_options
from autofit.solve.search import _time_floor, search
from zoo import ZOO

needs_fork = pytest.mark.skipif(not hasattr(os, "fork") or not os.sys.platform.startswith("linux"),
                                reason="worker processes need fork (Linux)")


@pytest.fixture(autouse=True)
def _threads_of_this_test_only(monkeypatch):
    """Threads that earlier tests in this process left behind (a library's non-daemon pool, such as inductor's
    compile workers) are not this test's: the rule under test, no workers beside a non-daemon thread, sees the
    threads each test starts itself and those of autofit."""
    before = set(threading.enumerate()) - {threading.current_thread()}
    alive = threading.enumerate
    monkeypatch.setattr(threading, "enumerate", lambda: [t for t in alive() if t not in before])


@pytest.fixture
def two_workers(monkeypatch):
    monkeypatch.setenv(workers.ENV, "2")
    monkeypatch.setattr(workers, "_cores", lambda: 2)


# ---- the workers themselves ------------------------------------------------------------------------------------------
@needs_fork
def test_run_all_keeps_order_and_uses_a_child(two_workers):
    values = workers.run_all([lambda i=i: (i * i, os.getpid()) for i in range(5)])
    assert [v for v, _ in values] == [0, 1, 4, 9, 16]
    pids = {pid for _, pid in values}
    assert os.getpid() in pids and len(pids) == 2, "jobs 0, 2, 4 here, 1 and 3 in one child"


def test_one_worker_runs_everything_here(monkeypatch):
    monkeypatch.setenv(workers.ENV, "1")
    assert workers.parallel_available() == 1
    assert {pid for pid in workers.run_all([os.getpid] * 3)} == {os.getpid()}


def test_no_workers_beside_a_thread_that_is_not_a_daemon(two_workers):
    import threading

    assert workers.parallel_available() == 2
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait)
    busy.start()
    try:
        assert workers.parallel_available() == 1
    finally:
        stop.set()
        busy.join()
    helper = threading.Thread(target=stop.wait, daemon=True)
    stop.clear()
    helper.start()
    try:
        assert workers.parallel_available() == 2
    finally:
        stop.set()
        helper.join()


def test_an_unreadable_setting_means_no_workers_and_says_so(monkeypatch):
    monkeypatch.setenv(workers.ENV, "many")
    with pytest.warns(UserWarning, match="AUTOFIT_WORKERS='many' is not a number"):
        assert workers.parallel_available() == 1


@needs_fork
def test_a_child_that_raises_is_rerun_here_and_raises_the_typed_error(two_workers):
    calls = []

    def job():
        calls.append(os.getpid())  # only this process's list survives
        raise ForwardError("module 'x' raised ValueError: bad", module="x")

    with pytest.raises(ForwardError, match="module 'x'"):
        workers.start(job).result()
    assert calls == [os.getpid()], "the error raised is the one this process's own run raised"


@needs_fork
def test_a_child_that_dies_is_replaced_by_a_run_here(two_workers):
    parent = os.getpid()

    def job():
        if os.getpid() != parent:
            os._exit(9)  # as if killed: no result written
        return "ran here"

    assert workers.start(job).result() == "ran here"


@needs_fork
def test_a_child_that_hangs_is_given_up_on_and_the_job_runs_here(two_workers):
    parent = os.getpid()

    def job():
        if os.getpid() != parent:
            time.sleep(600)  # as if waiting on a lock another thread held at the fork
        return os.getpid()

    started = time.perf_counter()
    pending = workers.start(job)
    assert pending.result(timeout=0.5) == parent
    assert time.perf_counter() - started < 10


@needs_fork
def test_cancel_stops_a_running_child(two_workers):
    pending = workers.start(lambda: time.sleep(60))
    assert pending.forked
    pid = pending._pid
    started = time.perf_counter()
    pending.cancel()
    assert time.perf_counter() - started < 5
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped: no such child any more


@needs_fork
def test_a_child_reports_no_progress(two_workers, tmp_path):
    log = tmp_path / "stages"

    def listener(stage):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {stage.what}\n")

    with progress.listening(listener):
        workers.run_all([lambda: progress.report("here"), lambda: progress.report("in the child")])
    assert log.read_text().splitlines() == [f"{os.getpid()} here"]


@needs_fork
def test_a_child_killed_without_answering_is_replaced_by_a_run_here_with_a_warning(two_workers):
    parent = os.getpid()

    def job():
        if os.getpid() != parent:
            os.kill(os.getpid(), 9)  # what the kernel's out-of-memory killer does
        return "ran here"

    with pytest.warns(RuntimeWarning, match="worker process was killed"):
        assert workers.start(job).result() == "ran here"


@pytest.mark.sim
@needs_fork
def test_a_refused_fork_plans_in_this_process_with_one_warning(monkeypatch, two_workers):
    """A fork the system refuses (ENOMEM, as a 405B plan met it) leaves the plan as a run without workers makes it,
    with one warning, and no fork is tried again."""
    from autofit.planner import plan_with_analysis

    case = ZOO["gpt_sdpa"]()
    kw = dict(options=Options.of(device=autofit.Device(gpu="A100-80GB")), batch_size=8, target=case.target,
              loss_fn=case.loss_fn)
    monkeypatch.setenv(workers.ENV, "1")
    here, _ = plan_with_analysis(make_request(case.model, case.sample, "40GB", **kw))
    monkeypatch.setenv(workers.ENV, "2")
    monkeypatch.setattr(workers, "_fork_refused", False)
    tried = []

    def refuse():
        tried.append(1)
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "fork", refuse)
    with pytest.warns(RuntimeWarning, match=r"could not start a worker process \(Cannot allocate memory\)") as seen:
        there, _ = plan_with_analysis(make_request(case.model, case.sample, "40GB", **kw))
    assert tried == [1], "a refused fork is not tried again"
    assert len([w for w in seen if "worker process" in str(w.message)]) == 1
    assert there.to_json() == here.to_json()
    assert workers.parallel_available() == 1


# ---- simulations in workers equal simulations here ---------------------------------------------------------------
def _request(name, device="cuda", **kw):
    case = ZOO[name]()
    # a request, not a plan: any budget; 1 TB is over an A100's memory, which make_request refuses unless told
    device = autofit.Device(kind=device, gpu="A100-80GB" if device == "cuda" else None, allow_over_capacity=True)
    options = Options.of(precision="auto", savers=autofit.Savers(checkpoint="auto"), device=device,
                         layout=autofit.Layout(world_size=1, strategy=None), search=autofit.Search(alternatives=False))
    return make_request(case.model, case.sample, "1TB", options=options, batch_size=32, optimizer="adamw",
                        target=case.target, loss_fn=case.loss_fn, **kw)


def _analysis(request, policy):
    step = make_step_config(micro_batch_size=1, precision=policy, optimizer=request.optimizer,
                            device=request.device.kind, gpu=request.device.name)
    return analyse_model(request.model, request.batch, request.target, request.loss_fn, step,
                         device_rules=request.device.simulation_rules, probe_kernels=request.device.kind == "cpu")


def _same_analysis(a, b) -> None:
    for t1, t2 in ((a.timeline, b.timeline), (a.timeline_next, b.timeline_next)):
        assert t1.events == t2.events
        assert [(s.nbytes, s.category, s.op, s.module, s.phase) for s in t1.storages] == \
            [(s.nbytes, s.category, s.op, s.module, s.phase) for s in t2.storages]
    assert pickle.dumps(a.profile) == pickle.dumps(b.profile)
    assert a.table == b.table
    assert pickle.dumps(a.ops) == pickle.dumps(b.ops)


@pytest.mark.sim
@needs_fork
@pytest.mark.parametrize("name", ["gpt_sdpa", "resnet_bn", "lstm", "unet"])
def test_an_analysis_in_workers_equals_one_here(name, monkeypatch):
    request = _request(name)
    policy = request.policies[0]
    monkeypatch.setenv(workers.ENV, "1")
    _analysis(request, policy)  # first-use effects of this process (see the closing note of issue 12) out of the way
    here = _analysis(request, policy)
    monkeypatch.setenv(workers.ENV, "2")
    monkeypatch.setattr(workers, "_cores", lambda: 2)
    forks = []
    real_fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or real_fork())
    there = _analysis(request, policy)
    assert forks, "the second size ran in a worker"
    _same_analysis(here, there)


@pytest.mark.sim
def test_a_cpu_target_never_forks(monkeypatch, two_workers):
    """CPU kernel probes measure scratch memory under this process's thread count, and a forked worker can run only
    one thread (Note [parallel simulations])."""
    def refuse():
        raise AssertionError("forked a simulation that probes CPU kernels")
    monkeypatch.setattr(os, "fork", refuse)
    request = _request("resnet_bn", device="cpu")
    assert _analysis(request, request.policies[0]).profile is not None


@needs_fork
@pytest.mark.slow
def test_a_tight_plan_with_workers_equals_one_without(monkeypatch):
    """The analysis's two sizes, the rows-by-length guesses and the first guess beside the verification (Note [rows
    beside the verification]) in workers: the same plan, to the byte, as with every simulation here."""
    import autofit.solve.finish as planner  # the plan's finishing estimates, rows by length among them
    from autofit.solve.lengths import first_guesses

    torch.manual_seed(0)
    from benchmarks.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig(num_layers=2, hidden_size=64, intermediate_size=172, num_heads=4, vocab_size=500))
    ids = torch.randint(0, 500, (2, 64))
    a100 = autofit.Device(gpu="A100-80GB", allow_over_capacity=True)  # 1 TB: over the card
    kw = dict(batch_size=16, target=ids, device=a100, search=autofit.Search(variable_length=True))
    roomy = autofit.plan(model, ids, "1TB", **kw)
    assert roomy.micro_batch_size == 16
    smallest = pytest.raises(autofit.InfeasibleBudgetError, autofit.plan, model, ids, 1,
                             savers=autofit.Savers(offload=False), **kw)
    budget = (smallest.value.min_budget_bytes + roomy.device_bytes) // 2
    estimated_here = []  # (length, rows) of every table estimate this process makes (a child's are not seen)
    real_peak = planner._rows_peak
    monkeypatch.setattr(planner, "_rows_peak", lambda *a: estimated_here.append(a[-2:]) or real_peak(*a))
    monkeypatch.setenv(workers.ENV, "1")
    here = autofit.plan(model, ids, budget, **kw)
    serial = list(estimated_here)
    estimated_here.clear()
    monkeypatch.setenv(workers.ENV, "2")
    monkeypatch.setattr(workers, "_cores", lambda: 2)
    there = autofit.plan(model, ids, budget, **kw)
    assert here.micro_batch_size < 16 and len(here.rows_by_length) > 1, "a plan that needs the table"
    assert there.to_json() == here.to_json()
    first = first_guesses(64, here.micro_batch_size, 16)[0]
    assert first in serial, "without workers this process estimates the first guess itself"
    assert first not in estimated_here, "with a second worker it ran beside the verification, and was kept"


# ---- the pruned search --------------------------------------------------------------------------------------------
def _space(name, device):
    request = _request(name, device=device)
    parallel = Parallel()
    analyses = _analyse(request, parallel, request.policies, {})
    return _search_space(request, parallel, request.policies, analyses)


@pytest.mark.sim
@pytest.mark.parametrize("name,device", [("gpt_sdpa", "cuda"), ("unet", "cuda"), ("resnet_bn", "cpu"),
                                         ("torch_encoder", "cpu")])
def test_pruned_search_finds_the_winner_of_the_full_search(name, device):
    space = _space(name, device)
    full_best, _ = search(space, 10**15, prune=False)
    smallest = min(c.peak_bytes for c in search(space, 10**15, prune=False)[1])
    largest = full_best.peak_bytes
    checked = 0
    for i in range(12):  # budgets from the roomiest candidate's peak down to below the smallest
        budget = int(largest - (largest - smallest) * i / 10)
        space.evaluated.clear()
        full, _ = search(space, budget, prune=False)
        space.evaluated.clear()
        pruned, _ = search(space, budget)
        assert (pruned is None) == (full is None), budget
        if full is not None:
            checked += 1
            assert (pruned.precision, pruned.micro_batch_size, pruned.checkpoint, pruned.seconds) == \
                (full.precision, full.micro_batch_size, full.checkpoint, full.seconds), budget
    assert checked >= 5


@pytest.mark.sim
@pytest.mark.parametrize("name,device", [("gpt_sdpa", "cuda"), ("unet", "cuda")])
def test_time_floor_is_below_every_candidate(name, device):
    """Note [pruned search]: the floor must not exceed the modelled time of what the MILP finds, for every
    micro-batch and budget tried."""
    space = _space(name, device)
    _, everything = search(space, 10**15, prune=False)
    peaks = sorted({c.peak_bytes for c in everything})
    tried = 0
    for budget in peaks[:: max(1, len(peaks) // 6)]:
        for precision in space.precisions:
            for b, k, last in batch_options(space.batch_size):
                candidate = evaluate(space, precision, b, k, last, budget)
                if candidate is not None:
                    tried += 1
                    assert _time_floor(space, precision, b, k, last, budget) <= round(candidate.seconds, 12)
    assert tried > 10


# ---- rows by length: the first guesses ----------------------------------------------------------------------------
def test_first_guesses_by_hand():
    # L = 2048, 2 rows per micro-batch of 64: 4 rows at 1024, 8 at 512, 16 at 256
    assert first_guesses(2048, 2, 64) == [(1024, 4), (512, 8), (256, 16)]
    # 16 of 32 rows: 32 at 1024 (capped at the batch), then the cap again: no new guess
    assert first_guesses(2048, 16, 32) == [(1024, 32)]
    assert first_guesses(100, 3, 64) == [(50, 6), (25, 12), (13, 23)]


@pytest.mark.parametrize("budget", [50, 120, 400, 10**6])
def test_rows_by_length_with_guesses_up_front_is_the_same_table(budget):
    def peak(length, rows):  # a quadratic-attention-like peak, with a fixed part
        return 20 + rows * length // 64 + rows * length * length // 65536

    asked = []

    def counted(length, rows):
        asked.append((length, rows))
        return peak(length, rows)

    plain = rows_by_length(2048, 2, 64, budget, counted)
    one_by_one = list(asked)
    asked.clear()
    batched = []
    ahead = rows_by_length(2048, 2, 64, budget, counted,
                           lambda points: batched.extend(points) or [counted(*p) for p in points])
    assert ahead == plain
    assert batched == first_guesses(2048, 2, 64)
    assert set(asked) == set(one_by_one), "every guess estimated up front is one the table asks for"


# ---- a data-parallel strategy that cannot fit is not planned when another fits -----------------------------------
@pytest.mark.sim
def test_a_strategy_whose_states_miss_the_budget_is_planned_only_if_nothing_else_fits(monkeypatch):
    from autofit.planning import race

    planned = []
    real = race.plan_layout
    monkeypatch.setattr(race, "plan_layout", lambda request, parallel, *args: planned.append(parallel.strategy)
                        or real(request, parallel, *args))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    x, y = torch.randn(2, 1024), torch.randn(2, 1024)
    kw = dict(batch_size=16, target=y, loss_fn=torch.nn.functional.mse_loss, device="cpu")
    # DDP keeps every fp32 parameter, gradient and both AdamW moments on each rank: 16 bytes per parameter
    ddp_states = 4 * (1024 * 1024 + 1024) * 16
    assert ddp_states == 67_174_400 and ddp_states > 40 * 2**20
    plan = autofit.plan(model, x, "40MB", layout=autofit.Layout(world_size=4), **kw)
    assert plan.parallel.strategy == "fsdp2" and planned == ["fsdp2", "fsdp2"]  # its layouts: ZeRO-3 and ZeRO-2
    assert any(n.startswith("ddp not planned") and "64.06 MiB" in n for n in plan.notes), plan.notes
    alone = autofit.plan(model, x, "40MB", layout=autofit.Layout(world_size=4, strategy="fsdp2"), **kw)
    assert (plan.micro_batch_size, plan.checkpoint, plan.device_bytes) == \
        (alone.micro_batch_size, alone.checkpoint, alone.device_bytes)
    # when nothing fits, the error names the smallest budget of FSDP2's ZeRO-3 (its ZeRO-2 holds more: not planned);
    # DDP's states alone are over that budget, so its analysis could not name a smaller one (Note [ruled out by
    # arithmetic]): not simulated, and the error says why with the hand-counted figure
    planned.clear()
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(model, x, "10MB", layout=autofit.Layout(world_size=4), **kw)
    assert planned == ["fsdp2"], "DDP was simulated although its states alone exceed FSDP2's smallest budget"
    fsdp2_min = pytest.raises(autofit.InfeasibleBudgetError, autofit.plan, model, x, "10MB",
                              layout=autofit.Layout(world_size=4, strategy="fsdp2"), **kw)
    assert info.value.min_budget_bytes == fsdp2_min.value.min_budget_bytes < ddp_states
    assert "ddp not planned" in str(info.value) and "64.06 MiB per rank" in str(info.value), info.value


# ---- the first simulation in a process equals every later one ---------------------------------------------------------
_FIRST_AND_SECOND = """
import os, sys
os.environ["AUTOFIT_WORKERS"] = "1"
sys.path.insert(0, {tests!r})
from test_plan_speed import _request, _analysis
request = _request("lstm")
first, second = (_analysis(request, request.policies[0]) for _ in range(2))
same = first.timeline.events == second.timeline.events and first.timeline_next.events == second.timeline_next.events
sizes = sorted(s.nbytes for s in first.timeline.storages if s.category.value == "gradients" and s.nbytes == 512)
print(same, len(sizes))
"""


@pytest.mark.sim
def test_an_lstms_first_simulation_in_a_process_equals_the_next():
    """FakeTensorMode's dispatch cache returned mkldnn_rnn_layer_backward's two bias gradients in one storage on its
    first call and in two on a hit (corrections.py); the CPU kernel returns two. Run in a fresh process, as only
    the first call of a process showed it."""
    import subprocess
    import sys
    from pathlib import Path

    script = _FIRST_AND_SECOND.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True)
    same, bias_gradients = out.stdout.split()
    assert same == "True"
    assert int(bias_gradients) >= 2, "the two bias gradients of the first micro-batch, each in its own storage"



_EVERY_FIRST_AND_SECOND = """
import os, sys
os.environ["AUTOFIT_WORKERS"] = "1"
sys.path.insert(0, {tests!r})
from dataclasses import replace
from autofit.parallel.layout import Parallel
from autofit.solve.estimator import Estimator
from autofit.simulate.run import simulate_step
from autofit.solve.candidate import Candidate
from test_plan_speed import _request
from zoo import ZOO
differ, runs = [], 0
for name in sorted(ZOO):
    if name == "data_dependent":  # runs for real (Note [data-dependent models]): no fake tensor, no cache
        continue
    for device in ("cpu", "cuda"):
        request = _request(name, device=device)
        for policy in request.policies:
            config = Estimator(request, Parallel()).config(Candidate(policy.label, 3, 2, 3, (), 0, 0.0),
                                                                          policy)
            first, second = (simulate_step(request.model, request.batch, request.target, request.loss_fn, config,
                                           device_rules=request.device.simulation_rules).timeline for _ in range(2))
            runs += 1
            if first.events != second.events or [s.nbytes for s in first.storages] != \
                    [s.nbytes for s in second.storages]:
                differ.append(f"{{name}}/{{device}}/{{policy.label}}")
print(runs, ",".join(differ) or "none")
"""


@pytest.mark.slow(seconds=65)
def test_every_zoo_models_first_simulation_in_a_process_equals_the_next():
    """The same, over the accuracy zoo on both targets and every precision the planner tries, each simulated twice
    in one fresh process (the first run of each model meets its own shapes, so PyTorch's caches are cold for it).
    It found the order of autocast's cache frees changing from run to run (Note [autocast cache frees])."""
    import subprocess
    import sys
    from pathlib import Path

    script = _EVERY_FIRST_AND_SECOND.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, check=True)
    runs, differ = out.stdout.split()
    assert int(runs) >= 40, "every zoo model on both targets, fp32 and bf16 on the CPU"
    assert differ == "none", f"first and second simulations differ: {differ}"


def _tree_problem(rng):
    """A random checkpoint problem shaped as the memory model builds them: modules named as a tree (nesting by
    qualified name), some with two policies grouped (at most one chosen)."""
    import numpy as np

    from autofit.solve.checkpoint_milp import CheckpointProblem
    from autofit.solve.memory_model import nested_pairs

    modules = ["a", "a.x", "a.y", "a.y.p", "b", "b.z", "c"][: int(rng.integers(2, 8))]
    names, policies = [], []
    for m in modules:
        for policy in (("full", "selective") if rng.random() < 0.4 else ("full",)):
            names.append(m)
            policies.append(policy)
    n, rows = len(names), int(rng.integers(1, 6))
    coef = np.where(rng.random((rows, n)) < 0.6, -rng.integers(0, 300_000, size=(rows, n)), 0).astype(float)
    positive = rng.random((rows, n)) < 0.15
    coef[positive] = rng.integers(0, 50_000, size=int(positive.sum()))
    by = {}
    for u, name in enumerate(names):
        by.setdefault(name, []).append(u)
    return CheckpointProblem(tuple(names), rng.integers(0, 6, size=n).astype(float),
                             rng.integers(10_000, 1_000_000, size=rows).astype(float), coef,
                             nested_pairs(tuple(names)), tuple(policies),
                             tuple(tuple(g) for g in by.values() if len(g) > 1))


@pytest.mark.sim  # hundreds of small MILPs against brute force, as tests/test_solver.py's: over the quick budget
def test_the_most_a_stretch_can_drop_is_the_best_allowed_set_of_that_stretch_by_brute_force():
    """Note [the most a stretch can drop]: the bound that lets the MILP skip programs with no solution is, stretch by
    stretch, the most bytes any allowed set drops there, counted over every subset; and a program it calls
    infeasible has no solution by brute force (the MILP's answer is never changed)."""
    import itertools

    import numpy as np

    from autofit.solve.checkpoint_milp import brute_force_checkpoint, most_dropped, solve_checkpoint

    rng = np.random.default_rng(20261129)
    ruled_out = 0
    for _ in range(150):
        problem = _tree_problem(rng)
        n = len(problem.names)
        allowed = [c for r in range(n + 1) for c in itertools.combinations(range(n), r) if problem.allowed(c)]
        drops = np.maximum(-problem.coef, 0.0)
        truth = np.array([max(sum(drops[row, u] for u in c) for c in allowed) for row in range(len(problem.base))])
        assert np.array_equal(most_dropped(problem), truth)
        peaks = sorted(problem.peak(c) for c in allowed)
        for budget in {peaks[0] - 1, peaks[0], peaks[len(peaks) // 2]}:
            assert (solve_checkpoint(problem, budget) is None) == (brute_force_checkpoint(problem, budget) is None)
            ruled_out += float(np.max(problem.base - truth)) > budget
    assert ruled_out > 20  # the bound does rule programs out
