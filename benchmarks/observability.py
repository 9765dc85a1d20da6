"""What observability costs the dispatcher: drain N operations (SQLite) with logging at
WARNING (the library's default: nothing configured) vs INFO (every event rendered as a
JSON line into /dev/null), with Prometheus metrics on, with OpenTelemetry tracing on
(the real SDK, a batch processor, an exporter that drops), and with both.

``python -m benchmarks.observability [--n 2000] [--concurrency 64] [--repeat 3]
[--smoke]`` prints medians and ratios to the baseline. Repetitions are interleaved
(every variant once per round) so the machine's drift hits them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from benchmarks.common import database, endpoint, receiver, workdir
from benchmarks.dispatch import drain, load

VARIANTS = ("baseline", "logging_info", "metrics", "tracing", "metrics_tracing")


@contextlib.contextmanager
def _info_logging() -> Iterator[None]:
    from outbox.base import logs

    sink = open(os.devnull, "w")  # noqa: SIM115
    handler = logging.StreamHandler(sink)
    handler.setFormatter(logs.JsonFormatter())
    log = logging.getLogger("outbox")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(logging.NOTSET)
        sink.close()


def _tracer_provider() -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    return provider


def run_variant(
    variant: str, db_url: str, rx_url: str, n: int, concurrency: int
) -> tuple[float, float]:
    """(ops/s, CPU ms of this process per operation) of one dispatcher draining N fresh
    operations under ``variant``. CPU time is the steadier figure on a busy machine."""
    from outbox import Outbox

    provider = _tracer_provider() if "tracing" in variant else None
    ob = Outbox(
        db_url,
        endpoints=[endpoint(rx_url, concurrency=concurrency)],
        tracer_provider=provider,
    )
    try:
        if "metrics" in variant:
            from prometheus_client import CollectorRegistry

            ob.metrics(registry=CollectorRegistry())
        load(ob, n, f"obs-{uuid.uuid4().hex[:8]}-")
        scope = _info_logging() if variant == "logging_info" else contextlib.nullcontext()
        with scope:
            cpu = time.process_time()
            seconds, summary = asyncio.run(drain(ob, n, concurrency))
            cpu = time.process_time() - cpu
        if summary.succeeded != n:
            raise RuntimeError(f"{variant}: {summary.as_dict()} (expected {n} succeeded)")
    finally:
        ob.close()
        if provider is not None:
            provider.shutdown()
    return n / seconds, cpu * 1000 / n


def measure(
    n: int, concurrency: int, repeat: int, variants: Sequence[str] = VARIANTS,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:  # fmt: skip
    values: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    work = workdir()
    with receiver(work) as rx:
        # One unmeasured drain first: imports, the receiver's first connections.
        for variant in variants:
            with database("sqlite", work, "warmup") as url:
                run_variant(variant, url, rx.url, min(n, 200), concurrency)
        for round_ in range(repeat):
            for variant in variants:
                with database("sqlite", work, variant) as url:
                    ops, cpu_ms = run_variant(variant, url, rx.url, n, concurrency)
                values[variant].append(ops)
                cpu[variant].append(cpu_ms)
                say(f"round {round_ + 1} {variant}: {ops:,.0f} ops/s, {cpu_ms:.3f} CPU ms/op")
    medians = {v: statistics.median(xs) for v, xs in values.items()}
    cpu_medians = {v: statistics.median(xs) for v, xs in cpu.items()}
    base = medians.get("baseline")
    cpu_base = cpu_medians.get("baseline")
    return {
        "n": n,
        "concurrency": concurrency,
        "repeat": repeat,
        "values": values,
        "median_ops_per_s": medians,
        "ratio_to_baseline": {v: (m / base if base else None) for v, m in medians.items()},
        "cpu_ms_per_op": cpu,
        "median_cpu_ms_per_op": cpu_medians,
        "cpu_ratio_to_baseline": {
            v: (m / cpu_base if cpu_base else None) for v, m in cpu_medians.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.observability")
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the harness works")
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.repeat = 50, 1
    result = measure(args.n, args.concurrency, args.repeat)
    print(f"\ndispatch throughput, SQLite, N={args.n}, concurrency {args.concurrency}, "
          f"median of {args.repeat}:")  # fmt: skip
    for variant in VARIANTS:
        med = result["median_ops_per_s"][variant]
        ratio = result["ratio_to_baseline"][variant]
        cpu_ms = result["median_cpu_ms_per_op"][variant]
        cpu_ratio = result["cpu_ratio_to_baseline"][variant]
        print(f"  {variant:<16} {med:>9,.0f} ops/s ({ratio:.2f} of baseline)   "
              f"{cpu_ms:.3f} CPU ms/op ({cpu_ratio:.2f}x baseline)")  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
