"""Benchmark studies behind ``python -m lmtrain bench NAME`` (see ``lmtrain.cli.BENCH_COMMANDS``)."""
