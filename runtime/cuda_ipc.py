"""CUDA tensors handed to another process by IPC handle, as plain message fields.

``torch.multiprocessing`` shares a CUDA tensor by pickling the result of ``reduce_tensor``; here
its pieces travel as the fields of a :class:`phloem.runtime.messages.CudaIpcTensor` instead (no
pickle crosses a process boundary) and the receiver rebuilds the tensor with torch's own
``rebuild_cuda_tensor``. The receiver's tensor views the sender's memory: the sender must keep the
tensor alive until the receiver is done with it (``Engine.update_weights_from_tensor`` waits for
the engine's reply), and sender and receiver must be different processes.
"""

from __future__ import annotations

import torch
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.messages import CudaIpcTensor

__all__ = ["open_shared", "share"]


def share(name: str, tensor: torch.Tensor) -> CudaIpcTensor:
    """The IPC description of CUDA ``tensor`` under checkpoint name ``name``."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError(f"{name}: not a CUDA tensor")
    _, args = reduce_tensor(tensor.detach())
    (_, size, stride, offset, _, dtype, device, handle, storage_size, storage_offset, _,
     ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    return CudaIpcTensor(
        name=name,
        size=list(size),
        stride=list(stride),
        offset=offset,
        dtype=str(dtype).removeprefix("torch."),
        device=device,
        handle=handle,
        storage_size=storage_size,
        storage_offset=storage_offset,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle,
        event_sync_required=event_sync,
    )


def open_shared(spec: CudaIpcTensor, field: str = "named_tensors") -> torch.Tensor:
    """The sender's tensor, opened in this process (no copy). Raises ``InvalidRequest`` naming
    ``field`` when this process has no CUDA or the dtype is unknown."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise InvalidRequest(field, "CUDA tensors were sent, but this engine has no CUDA device")
    dtype = getattr(torch, spec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(field, f"{spec.name}: unknown dtype {spec.dtype!r}")
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(spec.size),
        tuple(spec.stride),
        spec.offset,
        torch.storage.TypedStorage,
        dtype,
        spec.device,
        spec.handle,
        spec.storage_size,
        spec.storage_offset,
        False,
        spec.ref_counter_handle,
        spec.ref_counter_offset,
        spec.event_handle,
        spec.event_sync_required,
    )
