"""Kernels outside the model code: native CPU kernels compiled from C on first use
(:mod:`vlite.kernels.native`), and how Triton kernel modules are loaded compiled or
interpreted (:mod:`vlite.kernels.triton_loading`, shared by the ``triton`` attention backend
and the mixture-of-experts kernels)."""
