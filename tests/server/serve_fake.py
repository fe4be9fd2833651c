"""`python -m tests.server.serve_fake FACTORY DRAIN_S [KWARGS_JSON]`: an app of tests/server/fakes.py served the way
`deepinfer serve` serves it (server/serve.py: a bound socket, uvicorn with the bounded drain at SIGTERM),
on a free loopback port, written as the first line of stdout."""

from __future__ import annotations

import json
import sys

from deepinfer_bench.server import serve as serving
from tests.server import fakes


def main() -> None:
    factory, drain_s = sys.argv[1], float(sys.argv[2])
    kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    app = getattr(fakes, factory)(**kwargs)
    sock = serving.bind_port("127.0.0.1", 0)
    serving.listen(sock, "127.0.0.1", 0)
    print(sock.getsockname()[1], flush=True)
    serving.run_app(app, sock, drain_timeout_s=drain_s, log_level="info")


if __name__ == "__main__":
    main()
