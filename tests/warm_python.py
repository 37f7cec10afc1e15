"""A Python that has imported torch, transformers and datasets once and forks a child for each script
it is asked to run (tests/conftest.py's run_python: step 2's process, torchrun's launcher, the tools,
submit.py, play.py). A fresh interpreter
spends several seconds of CPU on those imports, most of the time of a test whose run ends in a refusal;
a forked child starts with them done, and runs the script as `python SCRIPT ARGS` would: its own
process, `__main__`, argv, sys.path[0], working directory and environment, stdin from /dev/null, its
output in the files it is given, its exit status Python's (an exception: 1, SystemExit's code).

Requests, one JSON line each on stdin: {"argv": [SCRIPT or -m MODULE, ARGS...], "cwd": ..., "env": {...},
"stdout": FILE, "stderr": FILE, "timeout": seconds}; the answer, one JSON line on stdout: {"returncode": N,
"timed_out": true or false}. Libraries read some environment variables as they are imported (Hugging Face's
cache and offline settings): conftest.py sends a run here only when those are this one's.
"""
import atexit
import json
import os
import runpy
import signal
import sys
import tempfile
import threading
import time
import traceback

import datasets  # noqa: F401
import torch  # noqa: F401
import torch.distributed.run  # noqa: F401  (torchrun: the ranks it starts are fresh interpreters)
import transformers.modeling_utils  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401


def run_script(request):
    """In the forked child: run the script as its own program, then leave as Python does."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # found again from this environment's TMPDIR
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                           (2, request["stderr"], os.O_WRONLY)):
        os.dup2(os.open(path, mode), fd)
    sys.stdin, sys.stdout, sys.stderr = (open(0, closefd=False), open(1, "w", closefd=False),  # noqa: SIM115
                                         open(2, "w", closefd=False))
    module = request["argv"][1] if request["argv"][0] == "-m" else None  # python -m MODULE ARGS
    sys.argv = request["argv"][1:] if module else list(request["argv"])
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(sys.argv[0]))
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as leaving:
        if leaving.code is None or isinstance(leaving.code, int):
            code = leaving.code or 0
        else:
            print(leaving.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what an uncaught exception does: its traceback, status 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # as at the end of a program: wait for its non-daemon threads, then the exit handlers
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve():
    for line in sys.stdin:
        request = json.loads(line)
        child = os.fork()
        if child == 0:
            os.setpgid(0, 0)
            run_script(request)
        deadline = time.monotonic() + request["timeout"]
        timed_out = False
        while not (ended := os.waitpid(child, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                timed_out = True
                os.killpg(child, signal.SIGKILL)
                ended = os.waitpid(child, 0)
                break
            time.sleep(0.02)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(ended[1]), "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    serve()
