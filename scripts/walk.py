"""The walk of a question from `gali ask` to the attention kernel: which of gali's modules it passes through.

    python scripts/walk.py [--method gali] [--noise]

Runs `gali ask` in this process on the bundled demo model (a document past its 256-token window, so the method's
attention runs) under a profiler, and at every tensor attention op (SDPA, torch's CPU flash op or a logits matmul)
called from gali's engine takes the call stack: each different stack is one walk, printed with its counts. A *room*
is a module of gali_cli (frames of torch and transformers between them are left out: they are not ours to arrange);
the stack *enters* a room each time it moves into a different one, and *returns* when it moves back into a room
already on the stack below (A -> B -> A). Fewer rooms and fewer returns: a newcomer following the question reads
fewer files and comes back to fewer. Also printed: every gali module the whole question touched.
"""

import argparse
import contextlib
import io
import sys
import sysconfig
from pathlib import Path

KERNEL_OPS = {"scaled_dot_product_attention", "matmul", "baddbmm", "bmm", "einsum"}


def room(frame) -> str:
    module = frame.f_globals.get("__name__", "?")
    return module if module.startswith("gali_cli") else module.split(".")[0]


class Walk:
    """Records the stacks at the kernel ops called from the engine, and the gali modules entered at all."""

    def __init__(self) -> None:
        self.stacks: set[tuple[str, ...]] = set()
        self.touched: set[str] = set()

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            name = room(frame)
            if name.startswith("gali_cli"):
                self.touched.add(name)
            elif frame.f_globals.get("__name__") == "torch._ops" and frame.f_code.co_name == "__call__":
                self.kernel_op(frame.f_back)  # torch.ops.aten.* (the CPU flash kernel with its log-sum-exp)
        elif event == "c_call" and getattr(arg, "__name__", "") in KERNEL_OPS:
            self.kernel_op(frame)

    def kernel_op(self, frame) -> None:
        if frame is None or not room(frame).startswith("gali_cli.engine"):
            return
        rooms = []
        while frame is not None:
            rooms.append(room(frame))
            frame = frame.f_back
        ours = [name for name in reversed(rooms) if name.startswith("gali_cli")]
        self.stacks.add(tuple(name for i, name in enumerate(ours) if i == 0 or name != ours[i - 1]))


def counts(stack: list[str] | tuple[str, ...]) -> tuple[int, int]:
    """(rooms entered, returns): consecutive frames in one module are one visit."""
    returns = sum(1 for i, name in enumerate(stack) if name in stack[:i])
    return len(stack), returns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="gali")
    args = parser.parse_args()
    import gali_cli.cli as cli
    from gali_cli.loading import demo_model_path

    root = Path(sysconfig.get_paths()["stdlib"])
    held_out = [line for line in (demo_model_path() / "heldout.txt").read_text().splitlines() if line]
    document = next(root / name for name in held_out if (root / name).exists() and (root / name).stat().st_size > 4000)
    walk = Walk()
    sys.setprofile(walk)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            cli.app(["ask", str(document), "What does this module do?", "-m", "demo", "--method", args.method,
                     "--max-new-tokens", "2", "--no-cache"], standalone_mode=True)
    finally:
        sys.setprofile(None)
    if not walk.stacks:
        raise SystemExit("walk: no attention op was called from gali's engine")
    for stack in sorted(walk.stacks, key=counts):
        entered, returns = counts(list(stack))
        print(f"{entered:2} rooms, {returns} returns: " + " -> ".join(name.removeprefix("gali_cli.") for name in stack))
    print(f"{len(walk.stacks)} walks to a kernel op; gali modules the question touched: {len(walk.touched)}")


if __name__ == "__main__":
    main()
