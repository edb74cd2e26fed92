"""A CUDA tensor handed to a second process through microrl's JSON CUDA-IPC handles, torch only.

    python benchmarks/ipc_roundtrip.py            # on a CUDA machine (exit 77 without one)

The transport of a full-weight push to a ``vllm serve`` on the trainer's own GPU
(microrl/rollout/vllm_plugin/ipc.py), without vLLM: this process fills a bfloat16 tensor on the
GPU, takes its CUDA IPC handle as vLLM's IPC engine does (``reduce_tensor``), encodes it with
``encode_update_info`` as the trainer's client does, and writes the JSON to a second Python's
stdin. That one decodes it (``decode_update_info``, as the server's worker does), maps the same
memory (``rebuild_cuda_tensor``), answers with its float64 sum, then doubles the tensor in place.
The round trip passes when the sums agree and this process then sees the doubled values: the
memory was shared, not copied. Its last line, ``KEY: ...``, is benchmarks/gpu_check.sh's
``ipc-roundtrip`` figure.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

SKIP_RC = 77  # gpu_check.sh's "nothing to do here"
ELEMENTS = 64 * 2**20  # 128 MiB of bfloat16: a packed buffer's order of size
TIMEOUT_S = 120  # the child: start, CUDA init, map, sum


def child() -> None:
    """Read the encoded handle on stdin, map the tensor, print its sum, then double it."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from microrl.rollout.vllm_plugin.ipc import decode_update_info

    info = decode_update_info(json.loads(sys.stdin.read()))
    (handles,) = info["ipc_handles"]
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    tensor = rebuild_cuda_tensor(*handles[uuid])
    total = tensor.double().sum().item()
    tensor.mul_(2)
    torch.cuda.synchronize()
    print(json.dumps({"sum": total, "shape": list(tensor.shape), "dtype": str(tensor.dtype)}))


def parent() -> int:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    from microrl.rollout.vllm_plugin.ipc import encode_update_info

    if not torch.cuda.is_available():
        print("KEY: no CUDA device: a CUDA IPC handle needs one")
        return SKIP_RC
    # Small integers times 1/8: exact in bfloat16, so doubled values compare exactly.
    tensor = (torch.arange(ELEMENTS, device="cuda") % 64).to(torch.bfloat16) / 8
    want = tensor.double().sum().item()
    uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
    _, args = reduce_tensor(tensor)
    payload = json.dumps(encode_update_info({"names": ["x"], "ipc_handles": [{uuid: args}]}))
    torch.cuda.synchronize()
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--child"],
        input=payload, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        print(done.stdout + done.stderr)
        print(f"KEY: the second process failed (exit {done.returncode})")
        return 1
    got = json.loads(done.stdout.splitlines()[-1])
    doubled = tensor.double().sum().item()
    ok = got["sum"] == want and doubled == 2 * want
    size = ELEMENTS * 2 / 2**20
    print(f"sums: sent {want}, received {got['sum']}; after the child's x2: {doubled}")
    verdict = "shared and equal" if ok else "MISMATCH"
    print(
        f"KEY: {size:.0f} MiB bf16 through a {len(payload)}-byte JSON handle: {verdict} "
        f"(child process {elapsed:.1f} s)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        child()
    else:
        sys.exit(parent())
