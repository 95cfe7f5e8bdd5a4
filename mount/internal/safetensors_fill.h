// The fill of state.safetensors' page cache from the bytes of its field
// files as the kernel gets them (MountOptions::fill_safetensors). Internal to mount/.
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <bitset>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mount/internal/fuse_context.h"
#include "mount/internal/push_gate.h"
#include "base/log.h"
#include "base/mutex.h"
#include "base/thread_annotations.h"

namespace optstate::mount::internal {

// The fill of one state.safetensors node: the pages that two field files
// share (a field whose size is not a whole number of pages ends inside one),
// assembled until both halves came.
struct SafetensorsPages {
  static constexpr uint64_t kPage = CachePusher::kPageBytes;
  // Pages left half filled (a field file read only in part) are dropped,
  // lowest first, beyond this many.
  static constexpr size_t kMaxPartialPages = 256;
  struct Partial {
    std::bitset<kPage> have;
    char bytes[kPage];
  };
  Mutex mu;
  std::map<uint64_t, std::unique_ptr<Partial>> partial GUARDED_BY(mu);  // page index -> bytes so far
};

// Fills state.safetensors' page cache from one field file's bytes as the
// kernel gets them (MountOptions::fill_safetensors): every range the field
// file's READs and CachePusher hand the kernel is stored again at its place in
// state.safetensors; the first field's first range brings the header pages
// with it (from the layout's memory), so every pass over the field files
// stores them once, also after the kernel dropped them. A `cp -r` of a
// generation directory reads tensors/ before state.safetensors
// (GenerationDirNames), so state.safetensors is then read from memory, not
// from the disk a second time: the two views hold the same bytes. The kernel
// marks a page up to date only when one store fills it whole (or up to EOF),
// so a page that two fields share is assembled in SafetensorsPages until both
// halves came. It needs the kernel to hold state.safetensors' node, which a
// READDIRPLUS of the generation directory (cp's listing) gives: a field file
// opened while it does not gets no fill (MakeSafetensorsFill). A store that
// fails (the node forgotten since, the daemon exiting) stops this file's
// fill; the kernel READs what is missing, as without a fill. Thread-safe.
class SafetensorsFill {
 public:
  SafetensorsFill(std::shared_ptr<PushGate> gate, std::shared_ptr<SafetensorsPages> pages, ReadStats* stats,
                  fuse_ino_t st_ino, uint64_t base, uint64_t field_bytes, uint64_t st_bytes,
                  const std::string* header)
      : gate_(std::move(gate)), pages_(std::move(pages)), stats_(stats), st_ino_(st_ino), base_(base),
        field_bytes_(field_bytes), st_bytes_(st_bytes), header_(header) {}

  // The kernel got the bytes of iov at `offset` of the field file.
  void Store(uint64_t offset, std::span<const iovec> iov) {
    if (stopped_.load(std::memory_order_relaxed) || offset >= field_bytes_) return;
    uint64_t len = 0;
    for (const iovec& v : iov) len += v.iov_len;
    len = std::min(len, field_bytes_ - offset);
    if (len == 0) return;
    if (offset == 0 && base_ == header_->size()) {  // the first field: the header pages too
      const iovec h{const_cast<char*>(header_->data()), header_->size()};  // whole pages: padded to one
      if (!Check(gate_->Store(st_ino_, 0, std::span<const iovec>(&h, 1)))) return;
    }
    // [s, e) in state.safetensors; whole pages [ps, pe) go straight in.
    const uint64_t s = base_ + offset, e = s + len;
    const uint64_t ps = (s + kPage - 1) / kPage * kPage;
    const uint64_t pe = e == st_bytes_ ? e : e / kPage * kPage;
    if (ps < pe) {
      std::vector<iovec> cut = Slice(iov, ps - s, pe - ps);
      if (!Check(gate_->Store(st_ino_, ps, cut))) return;
      stats_->filled_bytes.fetch_add(pe - ps, std::memory_order_relaxed);
    }
    if (s < ps) Assemble(iov, s, std::min(e, ps), s);
    if (pe < e && pe >= ps) Assemble(iov, pe, e, s);
  }

 private:
  static constexpr uint64_t kPage = SafetensorsPages::kPage;

  // [a, b) of state.safetensors, inside one page, from iov (whose byte 0 is
  // at s): into that page's partial copy; stores the page once it is whole.
  void Assemble(std::span<const iovec> iov, uint64_t a, uint64_t b, uint64_t s) {
    SafetensorsPages* pages = pages_.get();
    const uint64_t page = a / kPage, start = page * kPage;
    const uint64_t want = std::min(kPage, st_bytes_ - start);  // the last page ends at EOF
    char whole[kPage];
    {
      MutexLock l(&pages->mu);
      std::unique_ptr<SafetensorsPages::Partial>& p = pages->partial[page];
      if (p == nullptr) p = std::make_unique<SafetensorsPages::Partial>();
      uint64_t at = a;
      for (const iovec& v : Slice(iov, a - s, b - a)) {
        std::memcpy(p->bytes + (at - start), v.iov_base, v.iov_len);
        for (uint64_t i = at - start; i < at - start + v.iov_len; ++i) p->have.set(i);
        at += v.iov_len;
      }
      if (p->have.count() < want) {
        while (pages->partial.size() > SafetensorsPages::kMaxPartialPages) pages->partial.erase(pages->partial.begin());
        return;
      }
      std::memcpy(whole, p->bytes, want);
      pages->partial.erase(page);
    }
    const iovec v{whole, want};
    if (Check(gate_->Store(st_ino_, start, std::span<const iovec>(&v, 1)))) {
      stats_->filled_bytes.fetch_add(want, std::memory_order_relaxed);
    }
  }
  // The bytes [from, from + n) of iov, as iovecs into it.
  static std::vector<iovec> Slice(std::span<const iovec> iov, uint64_t from, uint64_t n) {
    std::vector<iovec> out;
    for (const iovec& v : iov) {
      if (n == 0) break;
      if (from >= v.iov_len) {
        from -= v.iov_len;
        continue;
      }
      const uint64_t take = std::min<uint64_t>(n, v.iov_len - from);
      out.push_back({static_cast<char*>(v.iov_base) + from, take});
      from = 0;
      n -= take;
    }
    return out;
  }
  // rc of a store: false and the fill stops unless it is 0.
  bool Check(int rc) {
    if (rc == 0) return true;
    if (!stopped_.exchange(true, std::memory_order_relaxed)) {
      OPTSTATE_LOG_DEBUG("optstate-mount: state.safetensors fill from its bytes {}..{} stops: {}", base_,
                         base_ + field_bytes_, std::strerror(-rc));
    }
    return false;
  }

  const std::shared_ptr<PushGate> gate_;
  const std::shared_ptr<SafetensorsPages> pages_;  // this node's, shared with the other field files' fills
  ReadStats* const stats_;                          // the Context's
  const fuse_ino_t st_ino_;
  const uint64_t base_;         // where byte 0 of the field lies in state.safetensors
  const uint64_t field_bytes_;
  const uint64_t st_bytes_;     // state.safetensors' size
  const std::string* const header_;  // the layout's; the handle's reader holds the generation
  std::atomic<bool> stopped_{false};
};

// The fill of state.safetensors from field file n (at `path`), or null: off,
// not a field file, state.safetensors not read through the page cache, or its
// node not held by the kernel.
std::shared_ptr<SafetensorsFill> MakeSafetensorsFill(Context* c, const std::string& path, const Node& n);

}  // namespace optstate::mount::internal
