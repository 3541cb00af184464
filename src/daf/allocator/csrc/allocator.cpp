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
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

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

// Large tensors: memory pages that move, not a heap that splits.
//
// tcmalloc serves a large block from a span of its heap and keeps the span when it is freed; a later
// request that fits no free span grows the heap, while the free spans stay resident. A training step
// allocates full-size tensors of several sizes in turn (ResNet-18 at batch 512: 98, 49, 25 MiB), so
// the spans split and the heap ends a third above the most that is ever live (833 against 620 MiB).
// Here every block of `large_from` bytes or more is a mapping of its own. A freed block is kept
// resident; the next block of the same size takes it as it is, and a block of another size takes
// kept memory wherever it is by moving it into its own range (mremap moves page tables, not bytes:
// no copy, no fault, no zeroing). So resident memory follows the most that is live at once, at full
// speed: nothing is given back, as with tcmalloc, but nothing kept is unusable.
constexpr size_t kAtom = size_t{2} << 20;  // alignment of a block's start: a move of 2 MiB is one entry
constexpr size_t kGrain = size_t{64} << 10;  // sizes are rounded to this (little waste on 12 MiB blocks)

struct LargeBlocks {
  std::mutex mutex;
  std::atomic<size_t> from{0};                     // 0: large blocks come from the library too
  std::unordered_map<uintptr_t, size_t> live;      // block -> its bytes (whole grains)
  std::multimap<size_t, uintptr_t> kept;           // freed ranges, resident: bytes -> start
  size_t kept_bytes = 0;
  uint64_t reused_whole = 0;                       // blocks handed out again as they were
  uint64_t moved_bytes = 0;                        // moved into another block
  uint64_t moves = 0;                              // mremap calls
  uint64_t fresh_bytes = 0;                        // new memory (faulted in on first touch), less what went back
  uint64_t given_bytes = 0;                        // freed pages given back for an untouched block
  // The part of the last block that took new memory, while no large block has come or gone since.
  struct Untouched {
    uintptr_t block = 0, start = 0;
    size_t size = 0;
    std::thread::id thread;
  } recent;
};

LargeBlocks g_large;

size_t round_up(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }

// `size` bytes of address space starting on an atom boundary, or 0.
uintptr_t reserve_aligned(size_t size) {
  const size_t span = size + kAtom;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return 0;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = round_up(begin, kAtom);
  if (start > begin) munmap(raw, start - begin);
  const uintptr_t end = begin + span;
  if (end > start + size) munmap(reinterpret_cast<void*>(start + size), end - start - size);
  return start;
}

void keep(uintptr_t start, size_t size) {
  g_large.kept.emplace(size, start);
  g_large.kept_bytes += size;
}

bool move(uintptr_t from, uintptr_t to, size_t size) {
  ++g_large.moves;
  return mremap(reinterpret_cast<void*>(from), size, size, MREMAP_MAYMOVE | MREMAP_FIXED,
                reinterpret_cast<void*>(to)) != MAP_FAILED;
}

// Moves `size` bytes at `from` to `to`: one call when the range is one mapping, else 2 MiB at a
// time (a range assembled from moved ones is several mappings, which one call cannot move), and
// 64 KiB pieces only across a boundary between mappings, so that moved ranges do not crumble into
// many small mappings (a process may have 65530). `moved` says how far it got; false if the system
// refused a piece (what did not move stays put).
bool move_range(uintptr_t from, uintptr_t to, size_t size, size_t* moved) {
  *moved = 0;
  if (move(from, to, size)) {
    *moved = size;
    return true;
  }
  while (*moved < size) {
    size_t piece = std::min(kAtom, size - *moved);
    if (!move(from + *moved, to + *moved, piece)) {
      piece = std::min(kGrain, size - *moved);
      if (!move(from + *moved, to + *moved, piece)) return false;
    }
    *moved += piece;
  }
  return true;
}

// A block of at least `nbytes`: a kept range of its size as it is, else kept memory moved into a new
// range; new memory only for what is not kept. nullptr when the system refuses.
void* allocate_large(size_t nbytes, size_t* size_out) {
  const size_t size = round_up(nbytes, kGrain);
  *size_out = size;
  {
    std::lock_guard<std::mutex> guard(g_large.mutex);
    auto same = g_large.kept.find(size);
    if (same != g_large.kept.end()) {
      const uintptr_t block = same->second;
      g_large.kept.erase(same);
      g_large.kept_bytes -= size;
      ++g_large.reused_whole;
      g_large.live.emplace(block, size);
      g_large.recent = {};
      return reinterpret_cast<void*>(block);
    }
  }
  const uintptr_t block = reserve_aligned(size);
  if (block == 0) return nullptr;
  // The new range under PyTorch's huge-page switch, as blocks from the library get it (kept ranges
  // moved in bring their own advice).
  const size_t huge_from = g_library.huge_pages_from.load(std::memory_order_relaxed);
  if (huge_from != 0 && size >= huge_from) advise_huge_pages(reinterpret_cast<void*>(block), size);
  std::lock_guard<std::mutex> guard(g_large.mutex);
  size_t filled = 0;
  while (filled < size && !g_large.kept.empty()) {
    const size_t need = size - filled;
    auto pick = g_large.kept.lower_bound(need);  // the smallest range that covers the rest, else the largest
    if (pick == g_large.kept.end()) pick = std::prev(g_large.kept.end());
    const size_t have = pick->first;
    const uintptr_t start = pick->second;
    g_large.kept.erase(pick);
    g_large.kept_bytes -= have;
    const size_t take = have < need ? have : need;
    size_t moved = 0;
    const bool whole = move_range(start, block + filled, take, &moved);
    g_large.moved_bytes += moved;
    filled += moved;
    if (have > moved) keep(start + moved, have - moved);  // the part that stayed where it was
    if (!whole) break;  // the rest of the block is new memory, as it would be without keeping any
  }
  g_large.fresh_bytes += size - filled;
  g_large.live.emplace(block, size);
  g_large.recent = {};
  if (filled < size) g_large.recent = {block, block + filled, size - filled, std::this_thread::get_id()};
  return reinterpret_cast<void*>(block);
}

// Whether no page of [start, start + size) was ever touched: none present, none swapped out
// (/proc/self/pagemap, bits 63 and 62; readable without privileges). False when it cannot say.
bool never_touched(uintptr_t start, size_t size) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);  // never cached: a fork's child is another self
  if (fd < 0) return false;
  constexpr uint64_t kPresentOrSwapped = uint64_t{3} << 62;
  uint64_t entries[512];
  const size_t first = start / page, count = size / page;
  bool clean = true;
  for (size_t done = 0; clean && done < count;) {
    const size_t n = std::min<size_t>(512, count - done);
    const ssize_t want = static_cast<ssize_t>(n * sizeof(uint64_t));
    clean = pread(fd, entries, want, static_cast<off_t>((first + done) * sizeof(uint64_t))) == want;
    for (size_t i = 0; clean && i < n; ++i) clean = (entries[i] & kPresentOrSwapped) == 0;
    done += n;
  }
  close(fd);
  return clean;
}

// A tensor allocated and dropped unused while its successor is allocated, as PyTorch's batch norm
// backward does with its gradient (`empty_like` twice, the first replaced before it is written),
// would hold kept memory while the successor faults in new pages: one full-size tensor more at the
// step's peak (ResNet-18: the fifth of five first-stage tensors). So when a block is freed just after
// another was given new memory, by the same thread, with nothing large in between, and none of that
// new memory has been touched yet, as many of the freed pages as that new memory needs go back to the
// system (munmap) instead of being kept: the successor's first writes fault them in again.
//
// The pages are given back, never moved into the successor (as they were until issue 42): the
// successor is a live block, and another thread may be writing it at this moment with the GIL
// released (os.readv from a pipe into a fresh buffer, fill_ in a worker), so a page found untouched
// by the pagemap read can be written before an mremap lands on it, and that write would be lost.
// Only the freed block, which no one can hold, is changed here; the successor is only read about,
// so a stale answer costs memory, never data. Bytes given back.
size_t give_back_for_untouched(uintptr_t block, size_t size) {
  const auto recent = g_large.recent;
  g_large.recent = {};
  if (recent.block == 0 || recent.block == block || recent.thread != std::this_thread::get_id()) return 0;
  const size_t take = std::min(size, recent.size);
  if (!never_touched(recent.start, take)) return 0;
  if (munmap(reinterpret_cast<void*>(block), take) != 0) return 0;
  g_large.given_bytes += take;
  g_large.fresh_bytes -= take;  // fresh counts the new memory held (kept or live): this left
  return take;
}

// Frees `ptr` if it is a large block: kept resident, or unmapped when large blocks are off.
bool release_large(void* ptr) {
  std::lock_guard<std::mutex> guard(g_large.mutex);
  if (g_large.live.empty()) return false;
  auto found = g_large.live.find(reinterpret_cast<uintptr_t>(ptr));
  if (found == g_large.live.end()) return false;
  const uintptr_t block = found->first;
  const size_t size = found->second;
  g_large.live.erase(found);
  count_live(-static_cast<int64_t>(size));
  if (g_large.from.load(std::memory_order_relaxed) == 0) {
    g_large.recent = {};
    munmap(ptr, size);
  } else {
    const size_t given = give_back_for_untouched(block, size);
    if (size > given) keep(block + given, size - given);
  }
  return true;
}

// Unmaps every kept range; their bytes.
size_t release_large_cache() {
  std::lock_guard<std::mutex> guard(g_large.mutex);
  for (const auto& [size, start] : g_large.kept) munmap(reinterpret_cast<void*>(start), size);
  const size_t bytes = g_large.kept_bytes;
  g_large.kept.clear();
  g_large.kept_bytes = 0;
  return bytes;
}

void release(void* ptr) {
  if (ptr == nullptr) return;
  c10::profiledCPUMemoryReporter().Delete(ptr);
  g_library.frees.fetch_add(1, std::memory_order_relaxed);
  if (release_large(ptr)) return;
  count_live(-static_cast<int64_t>(g_library.usable_size(ptr)));
  g_library.release(ptr);
}

struct LibraryCPUAllocator final : at::Allocator {
  at::DataPtr allocate(size_t nbytes) override {
    void* data = nullptr;
    const size_t large_from = g_large.from.load(std::memory_order_relaxed);  // a stale value picks the other path
    if (large_from != 0 && nbytes >= large_from) {
      size_t size = 0;
      data = allocate_large(nbytes, &size);
      if (data != nullptr) {
        c10::profiledCPUMemoryReporter().New(data, nbytes);
        count_live(static_cast<int64_t>(size));
        g_library.allocations.fetch_add(1, std::memory_order_relaxed);
        return {data, data, &release, at::Device(at::DeviceType::CPU)};
      }
    }
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

// The digest of this file, the flags and torch's version it was built from (-DDAF_BUILD_KEY=k...,
// daf/allocator/shim.py): a shim built at install is used only while that still holds.
#define DAF_STRINGIFY2(x) #x
#define DAF_STRINGIFY(x) DAF_STRINGIFY2(x)
#ifndef DAF_BUILD_KEY
#define DAF_BUILD_KEY unknown
#endif
const char* daf_allocator_build_key() { return DAF_STRINGIFY(DAF_BUILD_KEY); }

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
  // A fork (a DataLoader's workers) while another thread holds the large blocks' lock would leave
  // the child's copy locked forever: hold it across the fork, as allocators do.
  pthread_atfork([] { g_large.mutex.lock(); }, [] { g_large.mutex.unlock(); }, [] { g_large.mutex.unlock(); });
  // Priority above the default allocator's (0), so a later default registration cannot undo it.
  c10::SetCPUAllocator(&g_allocator, /*priority=*/1);
  return 0;
}

// Tensors of at least `bytes` allocated from now on are large blocks (above); 0 stops it and unmaps
// the kept ranges (blocks alive then are unmapped when freed).
void daf_allocator_set_large_from(size_t bytes) {
  {
    std::lock_guard<std::mutex> guard(g_large.mutex);
    g_large.from = bytes == 0 ? 0 : round_up(bytes, kGrain);
  }
  if (bytes == 0) release_large_cache();
}
size_t daf_allocator_large_from() { return g_large.from.load(); }
size_t daf_allocator_release_large_cache() { return release_large_cache(); }
// Counters of the large blocks: [reused whole, bytes moved, mremap calls, bytes new, bytes kept, blocks live,
// bytes given back for an untouched block].
void daf_allocator_large_counters(uint64_t* out) {
  std::lock_guard<std::mutex> g(g_large.mutex);
  out[0] = g_large.reused_whole;
  out[1] = g_large.moved_bytes;
  out[2] = g_large.moves;
  out[3] = g_large.fresh_bytes;
  out[4] = g_large.kept_bytes;
  out[5] = g_large.live.size();
  out[6] = g_large.given_bytes;
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
