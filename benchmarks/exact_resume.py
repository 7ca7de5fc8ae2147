"""Exact resume under SIGKILL: examples/train_gpt.py killed at random points and resumed each time.

    python3 -m benchmarks.exact_resume [--kills 6] [--world-size 2] [--other-world-size 1] [--seed 0]

First an uninterrupted reference run. Then the same run started again and again with ``--resume``,
each start killed (SIGKILL, one rank; the others are killed with it, as torchrun does) at a random
point: a random moment, a random rank in the middle of a random optimizer step, a random rank while
it writes its part of a checkpoint, or rank 0 just before a checkpoint's commit marker. After
``--kills`` kills, a last start runs to the end. The loss curves (every step's loss, every
evaluation) and the final parameters must equal the reference bit for bit. Last, a run without
dropout is resumed from its first checkpoint at ``--other-world-size`` ranks (with the same global
batch): equal to its uninterrupted end within fp32 summation differences (losses within 1e-4).
Writes OUT/exact_resume.json; exits 1 if a check fails.

Ranks are plain processes with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``...),
each ``python3 -m benchmarks.exact_resume child KILL -- EXAMPLE_ARGS``: the child installs the kill
(if any) and runs the example's ``main``. tests/unit/test_example.py runs one chosen kill of this.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Small enough for a minute on two CPU cores, with dropout so that the RNG streams matter.
EXAMPLE = [
    *("--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--dropout", "0.1"),
    *("--eval-interval", "5", "--eval-iters", "2", "--corpus-chars", "50000", "--sample-chars", "0"),
    *("--max-iters", "40", "--save-interval", "4", "--warmup-iters", "5"),
]


# ---------------------------------------------------------------------------------------- in a rank
def install_kill(spec: str) -> None:
    """Arrange for this process to SIGKILL itself at the point ``spec`` names (in this rank only).

    ``step:N:R``: rank R, in its N-th optimizer step of this start (after backward, before the update);
    ``write:N:R``: rank R, right after it wrote its file of the N-th checkpoint (before the metadata);
    ``commit:N``: rank 0, as it renames the N-th checkpoint's commit marker into place;
    ``none`` (or ``time:...``, which the parent does): nothing here.
    """
    kind, *nums = spec.split(":")
    if kind in ("none", "time"):
        return
    n = int(nums[0])
    rank = int(nums[1]) if len(nums) > 1 else 0
    if int(os.environ["RANK"]) != rank:
        return
    calls = [0]

    def die_at_nth() -> None:
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)

    if kind == "step":
        import torch

        step = torch.optim.AdamW.step

        def killing_step(self: Any, *args: Any, **kwargs: Any) -> Any:
            die_at_nth()
            return step(self, *args, **kwargs)

        torch.optim.AdamW.step = killing_step  # type: ignore[method-assign]
    elif kind == "write":
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def killing_write(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = write_data(self, *args, **kwargs)
            result.wait()  # this rank's file is written
            die_at_nth()
            return result

        FileSystemWriter.write_data = killing_write  # type: ignore[method-assign]
    elif kind == "commit":
        replace = os.replace

        def killing_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if Path(dst).name == "COMMITTED":
                die_at_nth()
            replace(src, dst, *args, **kwargs)

        os.replace = killing_replace
    else:
        raise SystemExit(f"unknown kill {spec!r}")


def child(argv: list[str]) -> None:
    kill, sep, *example_args = argv
    assert sep == "--", argv
    install_kill(kill)
    from examples.train_gpt import main

    main(example_args)


# ---------------------------------------------------------------------------------------- the parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: list[str], world_size: int, kill: str = "none", timeout: float = 300) -> dict[str, Any]:
    """Run the example on ``world_size`` CPU ranks with ``kill`` installed; wait for every rank.

    When one rank dies the others are killed at once, as torchrun does. ``time:S:R`` kills rank R
    from here after S seconds. Returns the exit codes, whether any rank was killed, and the output.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world_size))
    env.update(LOCAL_WORLD_SIZE=str(world_size))
    log = tempfile.TemporaryFile()  # rank 0's output (a pipe could fill up while nobody reads it)
    procs = []
    for rank in range(world_size):
        cmd = [sys.executable, "-m", "benchmarks.exact_resume", "child", kill, "--", *args]
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        out = log if rank == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=rank_env, stdout=out, stderr=subprocess.STDOUT))
    kind, *nums = kill.split(":")
    kill_at = time.monotonic() + float(nums[0]) if kind == "time" else None
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if kill_at is not None and time.monotonic() >= kill_at:
            procs[int(nums[1])].send_signal(signal.SIGKILL)
            kill_at = None
        failed = any(p.poll() not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.02)
    codes = [p.wait() for p in procs]
    log.seek(0)
    output = log.read().decode(errors="replace")
    log.close()
    return {"codes": codes, "killed": -signal.SIGKILL in codes, "output": output}


def compare(a: Path, b: Path) -> dict[str, Any]:
    """The loss curves and final parameters of two runs' out dirs: equal bit for bit, or how far apart."""
    import torch

    curves = [json.loads((d / "loss_curve.json").read_text()) for d in (a, b)]
    models = [torch.load(d / "model.pt", weights_only=True) for d in (a, b)]
    keys = ("iter", "train", "val", "step_loss")
    same_curve = all(curves[0][k] == curves[1][k] for k in keys)
    loss_diff = max(abs(x - y) for k in keys[1:] for x, y in zip(curves[0][k], curves[1][k], strict=True))
    same_params = list(models[0]) == list(models[1]) and all(
        torch.equal(models[0][k], models[1][k]) for k in models[0]
    )
    param_diff = max((models[0][k] - models[1][k]).abs().max().item() for k in models[0])
    return {
        "bit_identical": same_curve and same_params,
        "curve_identical": same_curve,
        "params_identical": same_params,
        "max_loss_diff": loss_diff,
        "max_param_diff": param_diff,
    }


def random_kill(rng: random.Random, world_size: int, steps_left: int, saves_left: int) -> str:
    rank = rng.randrange(world_size)
    kinds = ["time", "step"] + (["write", "commit"] if saves_left > 0 else [])
    kind = rng.choice(kinds)
    if kind == "time":
        return f"time:{rng.uniform(3.0, 20.0):.2f}:{rank}"
    if kind == "step":
        return f"step:{rng.randint(1, max(1, steps_left))}:{rank}"
    n = rng.randint(1, saves_left)
    return f"write:{n}:{rank}" if kind == "write" else f"commit:{n}"


def latest_step(out: Path) -> int:
    """The step of the newest committed checkpoint under out/checkpoints (0 if none)."""
    steps = [
        int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*") if (p / "COMMITTED").exists()
    ]
    return max(steps, default=0)


def chaos_run(
    out: Path, args: list[str], world_size: int, kills: int, rng: random.Random
) -> list[dict[str, Any]]:
    """Start, kill, resume, ``kills`` times, then run to the end; the starts' records."""
    max_iters = int(args[args.index("--max-iters") + 1])
    interval = int(args[args.index("--save-interval") + 1])
    starts: list[dict[str, Any]] = []
    while True:
        at = latest_step(out)
        kill = "none"
        if sum(s["killed"] for s in starts) < kills:
            saves_left = (max_iters - 1) // interval - at // interval + 1  # the last one after the outputs
            kill = random_kill(rng, world_size, max_iters - at, saves_left)
        resume = ["--resume"] if starts else []
        r = launch([*args, "--out-dir", str(out), *resume], world_size, kill)
        starts.append({"from_step": at, "kill": kill, "codes": r["codes"], "killed": r["killed"]})
        print(f"  start {len(starts)} at step {at}, kill {kill}: exit codes {r['codes']}")
        if not r["killed"]:
            if any(r["codes"]):
                raise SystemExit(f"a start failed without being killed:\n{r['output'][-3000:]}")
            return starts


def other_world_size(a: argparse.Namespace, args: list[str]) -> dict[str, Any]:
    """A run without dropout (whose masks depend on each rank's share of the batch), resumed from its
    first checkpoint at another world size with the same global batch; compared with its own end."""
    args = [*args, "--dropout", "0"]
    ref = a.out / "reference_no_dropout"
    r = launch([*args, "--out-dir", str(ref)], a.world_size)
    if any(r["codes"]):
        raise SystemExit(f"the reference run without dropout failed:\n{r['output'][-3000:]}")
    other = a.out / f"resumed_at_{a.other_world_size}"
    first = min((ref / "checkpoints").glob("step_*"))
    shutil.copytree(first, other / "checkpoints" / first.name)
    batch = a.batch_size * a.world_size // a.other_world_size
    print(f"resumed at {a.other_world_size} ranks from {first.name}, --batch-size {batch}")
    r = launch([*args, "--out-dir", str(other), "--resume", "--batch-size", str(batch)], a.other_world_size)
    if any(r["codes"]):
        raise SystemExit(f"the resume at {a.other_world_size} ranks failed:\n{r['output'][-3000:]}")
    return {"world_size": a.other_world_size, "from": first.name, **compare(ref, other)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--kills", type=int, default=6, help="how many starts are killed before one runs to the end"
    )
    p.add_argument("--world-size", type=int, default=2, help="ranks of the reference and the killed runs")
    p.add_argument(
        "--other-world-size", type=int, default=1, help="ranks of the resume at another world size (0: skip)"
    )
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank at --world-size")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill points")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "exact_resume", help="output directory")
    a = p.parse_args(argv)
    shutil.rmtree(a.out, ignore_errors=True)
    args = [*EXAMPLE, "--batch-size", str(a.batch_size)]
    print(f"reference: {a.world_size} ranks, uninterrupted")
    ref = launch([*args, "--out-dir", str(a.out / "reference")], a.world_size)
    if any(ref["codes"]):
        raise SystemExit(f"the reference run failed:\n{ref['output'][-3000:]}")
    print(f"killed {a.kills} times and resumed, {a.world_size} ranks")
    starts = chaos_run(a.out / "killed", args, a.world_size, a.kills, random.Random(a.seed))
    result: dict[str, Any] = {"example_args": args, "world_size": a.world_size, "starts": starts}
    result["killed_vs_reference"] = compare(a.out / "reference", a.out / "killed")
    ok = result["killed_vs_reference"]["bit_identical"]
    if a.other_world_size:
        result["other_world_size"] = other_world_size(a, args)
        ok = ok and result["other_world_size"]["max_loss_diff"] < 1e-4
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "exact_resume.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "example_args"}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(sys.argv[2:])
    else:
        sys.exit(main())
