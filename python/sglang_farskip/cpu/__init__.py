"""SGLang on CPU: the environment and defaults (environment.py), the CPU attention paths
(attention.py: MLA dispatch and MHA prefill; spec.py: speculative verify and draft decode) and
the upstream fixes. The sgl_kernel stand-in is python/cpu_shim/ (SGLang imports it by name)."""
