/* What the build compiled into each native module, read back by hicache/kernels/native_build.py:
   the hash of the sources it was built from and the sanitizers it carries, as setup.py passes
   them ("sha256=<hex> sanitize=<list or none>"). A module whose sources have changed since is
   refused as stale, and a sanitized build is told from a plain one. */
#ifndef HICACHE_NATIVE_BUILD_H
#define HICACHE_NATIVE_BUILD_H

#ifndef HICACHE_BUILD_INFO
#define HICACHE_BUILD_INFO "unknown" /* compiled without setup.py */
#endif

/* One per module; each module is a shared library of its own, so the names never meet. */
#define HICACHE_BUILD_INFO_SYMBOL \
    __attribute__((visibility("default"))) const char hicache_build_info[] = HICACHE_BUILD_INFO

#endif
