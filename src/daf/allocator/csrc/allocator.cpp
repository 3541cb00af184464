// PyTorch's CPU allocator backed by an allocator library loaded at run time.
//
// glibc's malloc keeps the heap that a training step's large, short-lived tensors once touched;
// tcmalloc (and jemalloc, mimalloc) reuse and return it (docs/allocator.md). The library is opened
// RTLD_LOCAL and called through its own posix_memalign/free, so it serves only the tensors PyTorch
// allocates from now on: the rest of the process keeps the system malloc, and every tensor
// allocated before keeps its own deleter (each DataPtr carries one).
//
// State here is process-wide by nature: PyTorch holds one CPU allocator per process.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <dlfcn.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

namespace {

using AlignedAlloc = int (*)(void**, size_t, size_t);
using Free = void (*)(void*);
using UsableSize = size_t (*)(void*);

// 64 bytes, as c10::alloc_cpu: AVX-512 loads and the kernels' vector paths assume it.
constexpr size_t kAlignment = 64;

struct Library {
  std::string path;
  AlignedAlloc aligned_alloc = nullptr;
  Free release = nullptr;
  UsableSize usable_size = nullptr;
  std::atomic<uint64_t> allocations{0};
  std::atomic<uint64_t> frees{0};
  // Bytes of live tensors (as the library rounds them) and their high-water mark: what a memory
  // timeline needs, without the profiler's per-pointer table.
  std::atomic<int64_t> live_bytes{0};
  std::atomic<int64_t> peak_bytes{0};
  // Blocks of at least this many bytes are advised into transparent huge pages (0: none).
  std::atomic<size_t> huge_pages_from{0};
};

Library g_library;
std::mutex g_install;

void count_live(int64_t delta) {
  int64_t live = g_library.live_bytes.fetch_add(delta, std::memory_order_relaxed) + delta;
  int64_t peak = g_library.peak_bytes.load(std::memory_order_relaxed);
  while (live > peak && !g_library.peak_bytes.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
  }
}

// When freed memory goes back to the system at once (tcmalloc's aggressive decommit), every reuse
// of a large block faults it in again: 2 MiB pages fault 512 times less often than 4 KiB ones
// (a ResNet-18 step at batch 512: 6.8 -> 5.0 s, kept memory 4.0 s; docs/allocator.md). Only the
// whole 2 MiB pages inside the block are advised; the kernel decides (THP "madvise" or "always").
void advise_huge_pages(void* data, size_t nbytes) {
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + nbytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

void release(void* ptr) {
  if (ptr == nullptr) return;
  c10::profiledCPUMemoryReporter().Delete(ptr);
  count_live(-static_cast<int64_t>(g_library.usable_size(ptr)));
  g_library.release(ptr);
  g_library.frees.fetch_add(1, std::memory_order_relaxed);
}

struct LibraryCPUAllocator final : at::Allocator {
  at::DataPtr allocate(size_t nbytes) override {
    void* data = nullptr;
    if (nbytes > 0) {
      if (g_library.aligned_alloc(&data, kAlignment, nbytes) != 0 || data == nullptr) {
        c10::profiledCPUMemoryReporter().OutOfMemory(nbytes);
        TORCH_CHECK_WITH(OutOfMemoryError, false, "DAF's CPU allocator (", g_library.path,
                         ") could not allocate ", nbytes, " bytes");
      }
      const size_t huge_from = g_library.huge_pages_from.load(std::memory_order_relaxed);
      if (huge_from != 0 && nbytes >= huge_from) advise_huge_pages(data, nbytes);
      c10::profiledCPUMemoryReporter().New(data, nbytes);
      count_live(static_cast<int64_t>(g_library.usable_size(data)));
      g_library.allocations.fetch_add(1, std::memory_order_relaxed);
    }
    return {data, data, &release, at::Device(at::DeviceType::CPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

LibraryCPUAllocator g_allocator;

void set_error(char* error, size_t size, const std::string& text) {
  if (error != nullptr && size > 0) std::snprintf(error, size, "%s", text.c_str());
}

}  // namespace

extern "C" {

// Opens the library, checks that it allocates and frees, and makes it PyTorch's CPU allocator.
// Returns 0 on success (also when the same library is installed already), else 1 with a sentence
// in `error`. Never aborts: a library that cannot be opened leaves the system allocator in place.
int daf_allocator_install(const char* path, char* error, size_t error_size) {
  std::lock_guard<std::mutex> guard(g_install);
  if (!g_library.path.empty()) {
    if (g_library.path == path) return 0;
    set_error(error, error_size, "another allocator is installed already: " + g_library.path);
    return 1;
  }
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = dlerror();
    set_error(error, error_size, std::string("dlopen failed: ") + (reason ? reason : "unknown"));
    return 1;
  }
  auto aligned_alloc = reinterpret_cast<AlignedAlloc>(dlsym(handle, "posix_memalign"));
  auto release_fn = reinterpret_cast<Free>(dlsym(handle, "free"));
  auto usable_size = reinterpret_cast<UsableSize>(dlsym(handle, "malloc_usable_size"));
  if (aligned_alloc == nullptr || release_fn == nullptr || usable_size == nullptr) {
    set_error(error, error_size, std::string(path) + " exports no posix_memalign/free/malloc_usable_size");
    return 1;  // the handle stays open: closing an allocator library is never safe
  }
  void* probe = nullptr;
  if (aligned_alloc(&probe, kAlignment, 1 << 20) != 0 || probe == nullptr ||
      reinterpret_cast<uintptr_t>(probe) % kAlignment != 0) {
    set_error(error, error_size, std::string(path) + " failed a 1 MiB aligned allocation");
    return 1;
  }
  std::memset(probe, 0, 1 << 20);
  release_fn(probe);
  g_library.aligned_alloc = aligned_alloc;
  g_library.release = release_fn;
  g_library.usable_size = usable_size;
  g_library.path = path;
  // Priority above the default allocator's (0), so a later default registration cannot undo it.
  c10::SetCPUAllocator(&g_allocator, /*priority=*/1);
  return 0;
}

// Tensors of at least `bytes` allocated from now on are advised into huge pages; 0 stops it.
void daf_allocator_set_huge_pages_from(size_t bytes) {
  g_library.huge_pages_from.store(bytes, std::memory_order_relaxed);
}
size_t daf_allocator_huge_pages_from() { return g_library.huge_pages_from.load(std::memory_order_relaxed); }

// The installed library's path, or "" when none is.
const char* daf_allocator_path() { return g_library.path.c_str(); }

// Whether PyTorch's CPU allocator is this one now (another library may have replaced it).
int daf_allocator_active() { return c10::GetCPUAllocator() == &g_allocator ? 1 : 0; }

// Tensors allocated and freed through it since it was installed.
uint64_t daf_allocator_allocations() { return g_library.allocations.load(std::memory_order_relaxed); }
uint64_t daf_allocator_frees() { return g_library.frees.load(std::memory_order_relaxed); }

// Bytes of tensors alive now, and the most alive at once since the last reset.
int64_t daf_allocator_live_bytes() { return g_library.live_bytes.load(std::memory_order_relaxed); }
int64_t daf_allocator_peak_bytes() { return g_library.peak_bytes.load(std::memory_order_relaxed); }
void daf_allocator_reset_peak() {
  g_library.peak_bytes.store(g_library.live_bytes.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // extern "C"
