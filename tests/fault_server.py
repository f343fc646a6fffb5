"""`snapcompile serve` in a process of its own whose engine thread dies of a bug once a request is
decoding: `python -m tests.fault_server ARTIFACT --port P ...` (the arguments of `serve`).

The fault is planted in EngineLoop._publish_gauges, which runs outside EngineCore.step's own fault
handling: exactly the kind of bug the loop's supervision must catch."""
import sys

from snapcompile.cli import main
from snapcompile.engine import loop as engine_loop

_real = engine_loop.EngineLoop._publish_gauges


def _publish_gauges(self):
    if self.core.scheduler.decoding:
        raise RuntimeError("planted bug in the engine loop")
    _real(self)


engine_loop.EngineLoop._publish_gauges = _publish_gauges

if __name__ == "__main__":
    main(["serve", *sys.argv[1:]], prog_name="snapcompile")
