"""A double of CUDA graph capture for the CPU: what a backend issues under capture is recorded, not run (as
CUDA records kernels without running them), and a replay runs it again on the same buffers. The backends'
bookkeeping (buckets, static buffers, when to capture, replay and drop graphs) then runs where no GPU is.

The capture also runs the work once under torch's FakeTensorMode, which computes shapes without data and
refuses what a CUDA graph cannot hold: an op that reads values on the host (.item(), .tolist()) or whose
output shape depends on them (nonzero, boolean masks). What a real capture adds (kernels bound to fixed
addresses, the memory pool) runs on a GPU only."""

from __future__ import annotations


class HostGraph:
    def __init__(self, body, log):
        self.body, self.log = body, log

    def replay(self) -> None:
        self.log.append("replay")
        self.body()


class HostCapturer:
    """capture(body) -> a HostGraph of it; `fail`: an exception every capture raises (a failed capture)."""

    def __init__(self, fail: Exception | None = None):
        self.fail = fail
        self.log: list[str] = []

    def capture(self, body) -> HostGraph:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.log.append("capture")
        if self.fail is not None:
            raise self.fail
        with FakeTensorMode(allow_non_fake_inputs=True):  # no data: nothing is computed or written
            body()
        return HostGraph(body, self.log)
