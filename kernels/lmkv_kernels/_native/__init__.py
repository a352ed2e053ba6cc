"""lmkv_kernels' C extension (``_host``, from ``host.c``), built at install where a
C compiler is at hand; optional: ``lmkv_kernels.host_impl`` says whether it is."""
