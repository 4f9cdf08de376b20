"""Run by tests/unit/test_forkserver.py as `python -m tests.unit.forked_probe CODE [sleep]`, forked or not: prints
what a service sees of its start (argv, folder, environment, session, import path) as JSON, then exits with CODE
(after sleeping, when asked)."""

import json
import os
import sys
import time

if __name__ == "__main__":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("RADIXMESH_PROBE"),
                      "sid_is_pid": os.getsid(0) == os.getpid(), "path0": sys.path[0], "name": __name__,
                      "torch": "torch" in sys.modules}), flush=True)
    if len(sys.argv) > 2:
        time.sleep(float(sys.argv[2]))
    sys.exit(int(sys.argv[1]))
