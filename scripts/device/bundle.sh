#!/bin/bash
# Build .devb/: what the benchmarks need on a machine with no network (the GPU
# machine some sessions are lent: Python 3.12, torch and Triton there, nothing
# else of lmkv's): cp312 wheels of lmkv, its plugins and the dependencies that
# machine lacks, Mooncake's package trimmed to what the tier runs (a tarball,
# under the 64 MiB a call carries), and Debian's libraries Mooncake and
# redis-server link (used there only for those the image lacks).
#   scripts/device/bundle.sh      then, there: bash scripts/device/run.sh
set -eu
cd "$(dirname "$0")/../.."
grep -qx '/.devb/' .git/info/exclude 2>/dev/null || echo '/.devb/' >> .git/info/exclude
rm -rf .devb && mkdir -p .devb/whl .devb/deb
PY=${PY:-.venv/bin/python}
tags="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for p in pydantic pydantic_core annotated-types typing-inspection msgspec zstandard pyzmq redis; do
  v=$($PY -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $tags -d .devb/whl "$p==$v"
done
# lmkv's C accelerator is optional: the pure wheel (py3-none-any) runs on any Python.
$PY -m pip wheel -q --no-deps --no-build-isolation . plugins/lmkv-mooncake plugins/lmkv-redis \
  -w .devb/whl
tmp=$(mktemp -d)
version=$($PY -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
(cd "$tmp" && unzip -q "$OLDPWD"/.devb/whl/lmkv-0*-cp3*.whl && rm -f lmkv/_ext/*.so &&
 sed -i 's/^Tag: .*/Tag: py3-none-any/; s/^Root-Is-Purelib: .*/Root-Is-Purelib: true/' \
   lmkv-*.dist-info/WHEEL && sed -i '/_tokens\.cpython/d' lmkv-*.dist-info/RECORD &&
 rm "$OLDPWD"/.devb/whl/lmkv-0*-cp3*.whl &&
 zip -qr "$OLDPWD/.devb/whl/lmkv-$version-py3-none-any.whl" .)
rm -rf "$tmp"
v=$($PY -m pip show mooncake-transfer-engine-non-cuda | awk '/^Version:/{print $2}')
tmp=$(mktemp -d)
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $tags -d "$tmp" "mooncake-transfer-engine-non-cuda==$v"
(cd "$tmp" && unzip -q mooncake*.whl && rm mooncake*.whl mooncake/transfer_engine_bench &&
 tar -cf - . | xz -9 -T0 > "$OLDPWD"/.devb/mooncake-cp312.tar.xz)
rm -rf "$tmp"
(cd .devb/deb && apt-get download -q libibverbs1 librdmacm1 libnuma1 libnl-3-200 \
  libnl-route-3-200 libcurl4 libbrotli1 libgssapi-krb5-2 libk5crypto3 libkrb5-3 libkrb5support0 \
  libkeyutils1 libcom-err2 libldap-2.5-0 libsasl2-2 libsasl2-modules-db libnghttp2-14 libpsl5 \
  librtmp1 libssh2-1 libidn2-0 libunistring2 libgnutls30 libhogweed6 libnettle8 libgmp10 \
  libp11-kit0 libtasn1-6 libffi8 libzstd1 libssl3 redis-server redis-tools libatomic1 \
  libgcrypt20 libgpg-error0 libjemalloc2 liblz4-1 liblzf1 libsystemd0 libcap2 liblua5.1-0)
du -sh .devb
