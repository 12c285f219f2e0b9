"""A captured CUDA graph replayed after every switch and compared with the same forward run eagerly:
what the rollout's graphs would read if the switch moved a weight, a derived tensor or the KV cache.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch


class GraphCheck:
    """``forward()`` reads the watched tensors (and may write into them in place, as a decode step
    writes the KV cache) and returns one tensor. ``check()`` captures it on the first call, then
    replays the graph, runs ``forward()`` eagerly on the same inputs and compares bit for bit; it
    also compares every watched tensor's address with the one at capture."""

    def __init__(self, forward: Callable[[], torch.Tensor], watched: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self.forward, self.watched = forward, watched
        self.graph: Any = None
        self.out: torch.Tensor | None = None
        self.addresses: dict[str, int] = {}
        self.checks = 0

    def capture(self) -> None:
        side, current = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up off the capture stream (library handles, workspaces)
            for _ in range(2):
                self.forward()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self.forward()
        self.graph = graph
        self.addresses = {n: int(t.data_ptr()) for n, t in self.watched().items()}

    def check(self) -> dict[str, Any]:
        """{"equal": replay == eager bit for bit, "moved": [names], "elements_wrong", "captured": first call}."""
        captured = self.graph is None
        if captured:
            self.capture()
        now = {n: int(t.data_ptr()) for n, t in self.watched().items()}
        moved = sorted(n for n in set(now) | set(self.addresses) if now.get(n) != self.addresses.get(n))
        self.graph.replay()
        replayed = self.out.clone()
        eager = self.forward()
        torch.cuda.synchronize()
        same = replayed.shape == eager.shape and torch.equal(replayed, eager)
        wrong = 0 if same else int((replayed != eager).sum()) if replayed.shape == eager.shape else -1
        self.checks += 1
        return {"equal": bool(same), "moved": moved, "elements_wrong": wrong, "captured": captured,
                "eager": eager}
