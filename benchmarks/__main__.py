"""``python -m benchmarks run [--n N] [--concurrency 64] [--quick] [--smoke]``."""

from benchmarks.runner import main

raise SystemExit(main())
