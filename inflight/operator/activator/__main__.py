"""``python -m inflight.operator.activator [options]``: run the activator (what the chart's
activator Deployment runs). Owns the command line only; see ``app`` for the behaviour.
"""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from inflight.operator.activator.app import Activator
from inflight.operator.activator.clock import MonotonicClock
from inflight.operator.activator.holding import Limits


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, Limits]:
    d = Limits()
    parser = argparse.ArgumentParser(prog="python -m inflight.operator.activator",
                                     description="Hold requests for scaled-to-zero InferenceDeployments.")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-held", type=int, default=d.max_held, help="requests held per backend")
    parser.add_argument("--hold-timeout", type=float, default=d.hold_timeout_s, help="seconds one request is held")
    parser.add_argument("--retry-after", type=int, default=d.retry_after_s, help="Retry-After of a 503, seconds")
    parser.add_argument("--registration-grace", type=float, default=d.registration_grace_s,
                        help="seconds after start that requests for unreported backends are held, not 404")
    parser.add_argument("--probe-interval", type=float, default=d.probe_interval_s)
    parser.add_argument("--backend-template", default=d.backend_template,
                        help="the backend's base URL; {name}, {namespace} and {port} are filled in")
    args = parser.parse_args(argv)
    try:
        limits = Limits(max_held=args.max_held, hold_timeout_s=args.hold_timeout, retry_after_s=args.retry_after,
                        registration_grace_s=args.registration_grace, probe_interval_s=args.probe_interval,
                        backend_template=args.backend_template)
    except ValueError as exc:
        parser.error(str(exc))
    return args, limits


def main(argv: list[str]) -> None:
    args, limits = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    web.run_app(Activator(limits, MonotonicClock()).app(), host=args.host, port=args.port)


if __name__ == "__main__":
    main(sys.argv[1:])
