"""Only the optional C accelerator lives here; everything else is in pyproject.toml.

The extension is optional: where it cannot be compiled, lmkv falls back to
pure Python (same results, slower hashing of token lists).
"""

import os
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HOST = "lmkv_kernels._native._host"


def _links(compiler, body: str) -> bool:  # type: ignore[no-untyped-def]
    """Whether a program of ``body`` compiles and links against libxxhash."""
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "probe.c")
        with open(source, "w") as f:
            f.write(body)
        try:
            objects = compiler.compile([source], output_dir=tmp)
            compiler.link_executable(objects, "probe", output_dir=tmp, libraries=["xxhash"])
        except Exception:  # (CompileError, LinkError: no header or library)
            return False
    return True


class BuildExt(build_ext):
    """The C copies check chunks' checksums as they copy them (``copy_checked``)
    where libxxhash is installed (Debian: ``libxxhash-dev``), with its choice of
    the CPU's widest vectors where it has one; without it they copy only, and the
    checksum is computed in Python."""

    def build_extensions(self) -> None:
        for ext in self.extensions:
            if ext.name != HOST:
                continue
            probe = "#include <xxhash.h>\n%s\nint main(void){return (int)%s(\"\", 0);}\n"
            if _links(self.compiler, probe % ("#include <xxh_x86dispatch.h>",
                                              "XXH3_64bits_dispatch")):
                ext.define_macros += [("LMKV_XXHASH", "1"), ("LMKV_XXHASH_DISPATCH", "1")]
                ext.libraries += ["xxhash"]
            elif _links(self.compiler, probe % ("", "XXH3_64bits")):
                ext.define_macros += [("LMKV_XXHASH", "1")]
                ext.libraries += ["xxhash"]
        super().build_extensions()


setup(cmdclass={"build_ext": BuildExt}, ext_modules=[
    Extension("lmkv._ext._tokens", ["lmkv/_ext/tokens.c"], optional=True),
    # SIGBUS-safe file mappings (lmkv.contracts.mapped_file): without it, entry
    # files are read with pread instead of mapped.
    # Chunk buffers' reference counts and an arena's free list (lmkv.memory):
    # without it, the same in Python (a few more microseconds a chunk).
    Extension("lmkv._ext._memory", ["lmkv/_ext/memory.c"], optional=True),
    # Cache keys numbered by slot (lmkv.keys.slots): without it, the same in Python.
    Extension("lmkv._ext._slots", ["lmkv/_ext/slots.c"], optional=True),
    Extension("lmkv._ext._busguard", ["lmkv/_ext/busguard.c"], optional=True),
    # Multi-threaded memcpy copies between host-memory paged caches and chunk
    # buffers (lmkv_kernels.host_impl): without it, torch's copies (torch_ref).
    # With libxxhash (BuildExt), loads of stored chunks also check their checksums.
    Extension("lmkv_kernels._native._host", ["kernels/lmkv_kernels/_native/host.c"],
              optional=True),
])
