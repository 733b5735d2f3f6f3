"""The saved-tensor ledger: bytes autograd keeps for backward, per module, each storage counted once.

A leaf module (torch only): `loom memory` reads it; code that keeps tensors outside autograd's saved
tensors (a recomputation checkpoint keeps its inputs, sequence parallelism keeps a shard in place of a
gathered input) reports them to the active ledger itself, so the parallel code depends on this small
module, never on the measuring tool.
"""

from __future__ import annotations

import torch


def _storage_key(t: torch.Tensor):
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    st = local.untyped_storage()
    return st._cdata, st.nbytes()


class SavedTensorLedger:
    """Bytes saved for backward per module, each storage counted once, parameters and buffers excluded."""

    active: "SavedTensorLedger | None" = None

    def __init__(self, model: torch.nn.Module, module_hooks: bool = True):
        """`module_hooks=False`: one total under "outside", with no forward hooks on the model's modules (hooks
        inside a compiled block would change what is compiled)."""
        self.model = model
        self.module_hooks = module_hooks
        self.excluded = {_storage_key(t)[0] for t in [*model.parameters(), *model.buffers()]}
        self.seen: dict = {}  # storage -> label
        self.bytes: dict[str, int] = {}
        self.stack = ["outside"]
        self._handles = []

    def record(self, t: torch.Tensor) -> None:
        key, nbytes = _storage_key(t)
        if key in self.excluded or key in self.seen or nbytes == 0:
            return
        label = self.stack[-1]
        self.seen[key] = label
        self.bytes[label] = self.bytes.get(label, 0) + nbytes

    def _leave(self) -> None:  # a forward hook must return None (else it replaces the output)
        self.stack.pop()

    def _pack(self, t):
        self.record(t)
        return t

    def __enter__(self):
        for name, module in self.model.named_modules() if self.module_hooks else ():
            if not name:
                continue
            self._handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self.stack.append(n)))
            self._handles.append(module.register_forward_hook(lambda m, a, o: self._leave()))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        SavedTensorLedger.active = self
        return self

    def __exit__(self, *exc):
        SavedTensorLedger.active = None
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()

    def per_layer(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for label, n in self.bytes.items():
            parts = label.split(".")
            key = ".".join(parts[:2]) if parts[0] == "layers" else "outside layers"
            out[key] = out.get(key, 0) + n
        return out

    def breakdown(self, layer: str) -> dict[str, int]:
        """Bytes by module inside one layer (`attention` includes its core)."""
        prefix = layer + "."
        out: dict[str, int] = {}
        for label, n in self.bytes.items():
            if label.startswith(prefix):
                part = label[len(prefix):].split(".")[0]
                out[part] = out.get(part, 0) + n
        return out
