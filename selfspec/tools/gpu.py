"""The GPU run: what travels to a lent GPU machine, the two calls that run there, and their rehearsal here.

    python -P selfspec/tools/gpu.py pack        # here, before the lease: .gpu/pack/call1, call2
    python -P selfspec/tools/gpu.py plan        # here: the two run calls to issue back to back, checked, and the budget
    python -P selfspec/tools/gpu.py rehearse    # here, on the CPU: the same calls end to end on a tiny model
    python -P selfspec/tools/gpu.py unpack DIR OUT   # here, after: each returned step archive unpacked into OUT/

``pack`` fills ``.gpu/pack`` (the rehearsal uses ``.gpu/rehearse``, never the same folder) with what the working
tree lacks: the packages selfspec needs beyond the machine's own (gpu_plan: transformers 5.25 and huggingface_hub 2.4
over its 5.17 and 1.33, datasets, gguf, ...), unzipped from their Python 3.12 wheels into one xz-compressed tar (22
MiB of wheels -> 9 MiB); the built-in model's GGUF (94 MiB) in two parts; the user turns of the conversations to
regenerate (parquet). Call 1 carries the first part, call 2 the second with the rest, each call about 55 MiB with the
working tree. ``plan`` prints the calls (command, carry, timeout_s) and checks every limit of the device tool.
On the machine each call runs ``gpu.py there --call K`` (gpu_there: steps as capped child processes, each archived
into $OUT when it ends; gpu_steps: what each step does; gpu_plan: the steps' caps and the budget). The module
imports only the standard library at load time: the machine's packages are not set up when it starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__:
    from selfspec.tools import gpu_here as here
    from selfspec.tools import gpu_plan as plan
    from selfspec.tools import gpu_rehearse, gpu_steps, gpu_there
else:  # a script (python3 -P selfspec/tools/gpu.py): importing the selfspec package would import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_here as here  # type: ignore[no-redef]
    import gpu_plan as plan  # type: ignore[no-redef]
    import gpu_rehearse  # type: ignore[no-redef]
    import gpu_steps  # type: ignore[no-redef]
    import gpu_there  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -P selfspec/tools/gpu.py", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("pack", help=f"here: what the two calls carry, into {here.PACK}")
    sub.add_parser("plan", help="here: the calls to issue, their limits checked, and the budget")
    rh = sub.add_parser("rehearse", help=f"here, on the CPU: pack into {here.REHEARSAL} and both calls on a tiny model")
    rh.add_argument("--gap", type=float, default=0.0, help="seconds between the calls (over 30: a fresh machine)")
    for name in ("there", "step"):
        sp = sub.add_parser(name, help="on the GPU machine: a call" if name == "there" else "(there: one step)")
        if name == "step":
            sp.add_argument("name", choices=sorted(gpu_steps.STEPS))
            sp.add_argument("--back", type=Path, required=True)
            sp.add_argument("--seconds", type=float, required=True)
        sp.add_argument("--call", type=int, required=True, choices=[c.number for c in plan.CALLS])
        sp.add_argument("--pack", type=Path, default=Path(here.PACK))
        sp.add_argument("--out", type=Path, default=Path("gpu-out"))
        sp.add_argument("--rehearse", action="store_true", help="the rehearsal's sizes, on the CPU")
    up = sub.add_parser("unpack", help="here: the step archives a call returned, unpacked")
    up.add_argument("folder", type=Path)
    up.add_argument("out", type=Path)
    a = p.parse_args(argv)
    if a.verb == "pack":
        manifest = here.pack(ROOT / here.PACK)
        print(json.dumps(manifest, indent=1))
        return here.print_plan()
    if a.verb == "plan":
        return here.print_plan()
    if a.verb == "rehearse":
        return gpu_rehearse.rehearse(gap=a.gap)
    if a.verb == "there":
        return gpu_there.there(a.call, (ROOT / a.pack).resolve(), a.out.resolve(), a.rehearse)
    if a.verb == "step":
        ctx = gpu_steps.Ctx(a.call, (ROOT / a.pack).resolve(), a.back, a.seconds, a.rehearse, time.monotonic())
        return gpu_steps.STEPS[a.name](ctx)
    print("\n".join(str(d) for d in here.unpack(a.folder, a.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
