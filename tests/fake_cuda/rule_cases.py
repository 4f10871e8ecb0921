"""Each GPU rule broken once on fake CUDA, in a process of its own (`fake_cuda.run_module`): main() prints one
JSON object, case -> the violation's message ("" where the case must pass)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any


def cases() -> dict[str, Callable[[], Any]]:
    import torch
    import torch.distributed as dist

    from hpctrain.simulate.fake_cuda import runtime

    def mixed() -> None:
        torch.ones(4, device="cuda") + torch.ones(4)

    def scalar_on_host() -> None:  # a 0-d CPU tensor is a scalar to a CUDA kernel: allowed
        torch.ones(4, device="cuda") * torch.tensor(2.0)

    def cpu_on_nccl() -> None:
        dist.all_reduce(torch.ones(4))

    def device_on_nccl() -> None:
        dist.all_reduce(torch.ones(4, device="cuda"))

    def early_read() -> None:
        factor = torch.ones((), device="cuda").to("cpu", non_blocking=True)
        torch.ones(4) * factor

    def early_read_of_view() -> None:
        values = torch.ones(4, device="cuda").to("cpu", non_blocking=True)
        torch.ones(2) + values[:2]

    def read_after_sync() -> None:
        factor = torch.ones((), device="cuda").to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        torch.ones(4) * factor

    def read_after_event() -> None:
        factor = torch.ones((), device="cuda").to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        torch.ones(4) * factor

    def copy_back_to_device() -> None:  # stream-ordered after the copy: no host read
        host = torch.ones(4, device="cuda").to("cpu", non_blocking=True)
        host.to("cuda", non_blocking=True)

    def nonzero() -> None:
        torch.ones(4, device="cuda").nonzero()

    def boolean_index() -> None:
        x = torch.ones(4, device="cuda")
        x[x > 0]

    def masked_select() -> None:
        x = torch.ones(4, device="cuda")
        torch.masked_select(x, x > 0)

    def unique() -> None:
        torch.unique(torch.ones(4, device="cuda"))

    def integer_index() -> None:  # gathers by an index tensor: no sync
        torch.ones(4, device="cuda")[torch.tensor([0, 1], device="cuda")]

    def host_reads() -> None:  # counted, not refused: .item(), .tolist(), .cpu()
        x = torch.ones(2, device="cuda")
        x.sum().item()
        x.cpu()
        torch.ones((), device="cuda").to("cpu")

    def other_thread() -> None:
        failure: list[BaseException] = []
        tensor = torch.ones(4, device="cuda")

        def run() -> None:
            try:
                dist.all_reduce(tensor)
            except BaseException as exc:  # noqa: BLE001 (handed to the main thread)
                failure.append(exc)

        worker = threading.Thread(target=run, name="background")
        worker.start()
        worker.join()
        if failure:
            raise failure[0]

    def backward_thread() -> None:  # a collective in backward runs on autograd's device thread: allowed
        w = torch.ones(4, device="cuda", requires_grad=True)
        w.register_hook(lambda g: dist.all_reduce(g) or None)
        (w * 2).sum().backward()

    del runtime
    return {
        f.__name__: f
        for f in (
            mixed,
            scalar_on_host,
            cpu_on_nccl,
            device_on_nccl,
            early_read,
            early_read_of_view,
            read_after_sync,
            read_after_event,
            copy_back_to_device,
            nonzero,
            boolean_index,
            masked_select,
            unique,
            integer_index,
            host_reads,
            other_thread,
            backward_thread,
        )
    }


def main() -> None:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hpctrain.simulate.fake_cuda import runtime
    from hpctrain.simulate.fake_cuda.rules import GpuRules

    runtime.install()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    out: dict[str, Any] = {}
    for name, case in cases().items():
        rules = GpuRules()
        try:
            with FakeTensorMode(allow_non_fake_inputs=True), rules:
                case()
            out[name] = {"violation": "", "syncs": len(rules.syncs)}
        except Exception as exc:  # noqa: BLE001 (each case's outcome is the result)
            out[name] = {"violation": f"{type(exc).__name__}: {exc}", "syncs": len(rules.syncs)}
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    threading.excepthook = lambda args: None
    main()
