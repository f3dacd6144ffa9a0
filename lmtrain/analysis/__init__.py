"""Analysis of captured measurements, apart from their capture.

Pure functions over saved records (profiler traces, allocator snapshots, dtype reports, tables): no
Lightning, no hooks. The callbacks capture and hand their records here; the same functions serve
``python -m lmtrain analyze ...`` on files saved by anyone.
"""
