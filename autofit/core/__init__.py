"""The foundations every stage stands on: the torch boundary (``_torch``), typed errors and validators (``errors``),
bytes at the edges (``units``), memory categories, progress reporting, worker processes, this CPU's kernels
(``cpu``) and the memory figures ``estimate`` and ``measure`` hand back (``report``). Nothing here imports a stage."""
