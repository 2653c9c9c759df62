"""``python -m tests.hostile [MAX_EXAMPLES]``: run the hostile-traffic suite and print its figures."""

import sys

from tests.hostile.suite import serve_and_run

if __name__ == "__main__":
    report = serve_and_run(int(sys.argv[1]) if len(sys.argv) > 1 else 150)
    print("\n".join(report.lines()))
    sys.exit(0 if not report.wrong and not report.server_errors and not report.hangs else 1)
