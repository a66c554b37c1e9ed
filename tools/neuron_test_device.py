"""A stand-in ``neuron`` device for tests: PyTorch's PrivateUse1 backend renamed ``neuron``, backed by CPU memory.

It makes the Neuron dispatch of ``static_moe`` real on a machine without Trainium: tensors report
``device.type == "neuron"`` and carry the ``PrivateUse1`` dispatch key, so ``torch.ops.static_moe.*`` reach the
kernels ``static_moe.nki.dispatch.register_neuron_kernels`` registered for that key — the same code a Trainium
user's native ``neuron`` device runs — and those launch the NKI kernels through the shim's ``jit``, here the
repository's NKI interpreter (``tools/nki_interpreter``). Everything else (aten ops: views, casts, copies,
arithmetic) runs on the CPU tensor each device tensor wraps.

Mechanism (PyTorch's open registration from Python, as in PyTorch's own
``test/test_privateuseone_python_backend.py``): ``torch.utils.backend_registration.
_setup_privateuseone_for_python_backend("neuron")`` renames PrivateUse1 and installs a device module, hooks and a
device guard; :class:`NeuronTensor` is a wrapper subclass (``_make_wrapper_subclass``, device ``neuron:0``) whose
``host`` is the CPU tensor with its data. Its ``__torch_dispatch__`` runs aten ops on the hosts and wraps the
results (an op that returns one of its inputs, an in-place or ``out=`` op, gives back that input), and sends every
other namespace's op (``static_moe::*``) to the kernel registered for PrivateUse1, the way a C++ backend's
tensors reach it. Factories (``torch.empty(..., device="neuron")`` and the ops built on it) get PrivateUse1
kernels for ``aten::empty.memory_format`` / ``aten::empty_strided``.

Limits: one device (``neuron:0``); the process's PrivateUse1 name becomes ``neuron`` for good (PyTorch allows one
rename per process); no autograd through the NKI ops; ``torch.distributed`` cannot use these tensors (gloo
reads host storage through ``data_ptr``, which a wrapper subclass has none of), so collective (S > 1) steps do
not run here.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map

NAME = "neuron"
_installed: list[bool] = []
_lib: list = []


class NeuronTensor(torch.Tensor):
    """A tensor on ``neuron:0`` whose data is the CPU tensor ``host`` (same sizes, strides, offset, dtype)."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        if host.device.type != "cpu":
            raise ValueError(f"NeuronTensor wraps a CPU tensor, got one on {host.device}")
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            host.size(),
            strides=host.stride(),
            storage_offset=host.storage_offset(),
            dtype=host.dtype,
            device=f"{NAME}:0",
            requires_grad=False,
        )
        out.host = host
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"NeuronTensor({self.host!r})"

    def tolist(self):
        return self.host.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "aten":
            # A backend's own op (static_moe::*): the kernel registered for PrivateUse1, as for a C++ backend.
            return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1), *args, **kwargs)
        inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, NeuronTensor)]
        host_args, host_kwargs = tree_map(_host, (args, kwargs))
        to_other = False
        if host_kwargs.get("device") is not None:  # _to_copy and factories: where the result goes
            to_other = torch.device(host_kwargs["device"]).type != NAME
            host_kwargs["device"] = torch.device("cpu")
        out = func(*host_args, **host_kwargs)
        by_host = {id(t.host): t for t in inputs}

        def wrap(o):
            if not isinstance(o, torch.Tensor) or isinstance(o, NeuronTensor) or to_other:
                return o
            same = by_host.get(id(o))
            return NeuronTensor(o) if same is None else same

        return tree_map(wrap, out)


def _host(t):
    return t.host if isinstance(t, NeuronTensor) else t


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return NeuronTensor(torch.empty(size, dtype=dtype, memory_format=memory_format))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return NeuronTensor(torch.empty_strided(size, stride, dtype=dtype))


def _backend_module():
    """``torch.neuron``: the dummy device module plus the RNG state calls ``torch.random.fork_rng`` makes for every
    device type (torch.compile / opcheck fork the RNG of all devices): the device has no generator of its own,
    so its state is an empty byte tensor and setting it does nothing."""
    from torch.utils.backend_registration import _DummyBackendModule

    class _Module(_DummyBackendModule):
        def get_rng_state(self, device=None):
            return torch.empty(0, dtype=torch.uint8)

        def set_rng_state(self, state, device=None):
            pass

        def manual_seed(self, seed):
            pass

    return _Module()


def install() -> torch.device:
    """Rename PrivateUse1 to ``neuron`` (once per process), give it CPU-backed tensors, and register static_moe's
    NKI kernels for it (``register_neuron_kernels(keys=["PrivateUse1"])``). Returns ``torch.device("neuron:0")``.
    Raises RuntimeError where PrivateUse1 already has another name."""
    if not _installed:
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", NAME):
            raise RuntimeError(f"PrivateUse1 is already the {current!r} backend in this process")
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        if current != NAME:
            _setup_privateuseone_for_python_backend(NAME, backend_module=_backend_module())
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("empty.memory_format", _empty, "PrivateUse1")
        lib.impl("empty_strided", _empty_strided, "PrivateUse1")
        _lib.append(lib)  # kept alive: dropping the Library would unregister the kernels
        _installed.append(True)
    from static_moe.nki import dispatch

    dispatch.register_neuron_kernels(keys=["PrivateUse1"])
    return torch.device(f"{NAME}:0")


def to_device(t):
    """A CPU tensor (or None / a non-tensor, passed through) moved to ``neuron:0`` (a copy)."""
    return NeuronTensor(t.clone()) if isinstance(t, torch.Tensor) else t
