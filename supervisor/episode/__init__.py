"""One failure (or end) of a worker, from detection until its process tree is gone.

Owns: the episode (snapshot → dumps → kill → incident), the dump collector, the tree killer, DataLoader
workers' and the NCCL flight recorder's dumps, the kernel's evidence (OOM kills), each rank's evidence for
the verdict, and the incidents of exits, failed spawns and crash loops.

May import: `processes`, `watch`, `incidents`, `records` and `hangwatch.common`; never `loop` or `nodes`.
"""
