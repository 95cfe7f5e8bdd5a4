// The fill of state.safetensors' page cache (mount/internal/safetensors_fill.h).
#include "mount/internal/safetensors_fill.h"

namespace optstate::mount::internal {

std::shared_ptr<SafetensorsFill> MakeSafetensorsFill(Context* c, const std::string& path, const Node& n) {
  const MountOptions& o = c->tree->options();
  if (!FillsSafetensors(o) || n.gen == nullptr || n.file->kind != vfs::CheckpointFileKind::kField) return nullptr;
  const vfs::CheckpointLayout& layout = *n.gen->layout;
  const vfs::CheckpointFile* st = layout.FindFile(vfs::kSafetensorsFileName);
  std::optional<uint64_t> base = layout.SafetensorsOffsetOf(*n.file);
  if (st == nullptr || !CachedFile(o, *st) || !base.has_value() || path.size() <= n.rel.size()) return nullptr;
  const std::string dir = path.substr(0, path.size() - n.rel.size() - 1);
  const fuse_ino_t st_ino = NodeIdOf(JoinPath(dir, vfs::kSafetensorsFileName), n.gen->generation());
  std::shared_ptr<SafetensorsPages> pages;
  {
    MutexLock l(&c->mu);
    if (!c->nodes.count(st_ino)) return nullptr;  // the kernel could not take the stores
    std::shared_ptr<SafetensorsPages>& p = c->safetensors_pages[st_ino];
    if (p == nullptr) p = std::make_shared<SafetensorsPages>();
    pages = p;
  }
  return std::make_shared<SafetensorsFill>(c->push_gate, std::move(pages), &c->stats, st_ino, *base,
                                           n.file->size_bytes, st->size_bytes, &layout.safetensors_header());
}

}  // namespace optstate::mount::internal
