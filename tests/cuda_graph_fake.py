"""A double of CUDA graph capture for the CPU: what a backend issues under capture is recorded, not run (as
CUDA records kernels without running them), and a replay runs it again on the same buffers. The backends'
bookkeeping (buckets, static buffers, when to capture, replay and drop graphs) then runs where no GPU is;
what a real capture adds (kernels bound to fixed addresses, no host work at replay) runs on a GPU only."""

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
        self.log.append("capture")
        if self.fail is not None:
            raise self.fail
        return HostGraph(body, self.log)
