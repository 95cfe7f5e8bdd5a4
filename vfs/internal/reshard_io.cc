// Reshard's streaming I/O: the read-ahead of source chunks and the O_DIRECT
// writer of destination files (vfs/internal/reshard_io.h).
#include "vfs/internal/reshard_io.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "base/log.h"

namespace optstate::vfs::internal {

Result<std::unique_ptr<IoEngine>> NewReshardEngine(IoEngineOptions eo, uint64_t sync_staging_bytes) {
  // Plain fds: the copy submits one request of megabytes at a time, each to a
  // file it then closes, where a registered-file slot saves nothing and its
  // check (fcntl + fstat of the fd, per submission) is the only cost.
  eo.registered_file_slots = 0;
  auto e = IoEngine::NewUring(eo);
  if (!e.ok() && !eo.registered_buffers.empty()) {
    OPTSTATE_LOG_WARN("reshard: {}; going on without registered buffers", e.status().ToString());
    eo.registered_buffers.clear();
    e = IoEngine::NewUring(eo);
  }
  if (e.ok()) return std::move(*e);
  OPTSTATE_LOG_WARN("reshard: io_uring unavailable ({}); using synchronous I/O", e.status().ToString());
  return IoEngine::NewSync(sync_staging_bytes);
}

SourceReader::SourceReader(std::vector<FieldFile> files, std::vector<Item> items)
    : files_(std::move(files)), items_(std::move(items)), open_(files_.size()), left_(files_.size(), 0) {
  for (const Item& it : items_) ++left_[it.file];
}

SourceReader::~SourceReader() {
  std::vector<IoCompletion> done;
  while (engine_ && engine_->in_flight() > 0) {
    done.clear();
    if (!engine_->Reap(&done, 1).ok()) break;
  }
}

Status SourceReader::Init(uint32_t depth, uint64_t max_chunk_bytes) {
  depth_ = std::max<uint32_t>(1, depth);
  const uint64_t buf_bytes = (max_chunk_bytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  for (uint32_t i = 0; i < depth_; ++i) {
    IoBuffer b(buf_bytes);
    if (!b.ok()) {
      return ResourceExhausted(fmt::format("reshard: out of memory for {} read buffers of {} bytes", depth_,
                                           buf_bytes));
    }
    slots_.push_back({std::move(b), false, Status::Ok()});
  }
  IoEngineOptions eo;
  eo.queue_depth = depth_;
  for (Slot& s : slots_) eo.registered_buffers.push_back(s.buf.span());  // pinned once, not per read
  OPTSTATE_ASSIGN_OR_RETURN(engine_, NewReshardEngine(std::move(eo), buf_bytes));
  return Status::Ok();
}

Result<const char*> SourceReader::Next() {
  if (next_ >= items_.size()) return Internal("reshard: read past the last source chunk");
  if (next_ > 0) Release(next_ - 1);
  OPTSTATE_RETURN_IF_ERROR(Fill());
  if (failed_ && failed_item_ == next_) return failed_status_;
  const Item& it = items_[next_];
  Slot& s = slots_[next_ % depth_];
  std::vector<IoCompletion> done;
  while (!s.done) {
    done.clear();
    OPTSTATE_RETURN_IF_ERROR(engine_->Reap(&done, 1));
    for (IoCompletion& c : done) {
      slots_[c.tag].done = true;
      slots_[c.tag].status = std::move(c.status);
    }
  }
  FileState& f = open_[it.file];
  if (!s.status.ok()) return s.status.WithContext("reshard: " + files_[it.file].context);
  const uint64_t aligned = AlignedPart(f, it);
  char* buf = reinterpret_cast<char*>(s.buf.data());
  if (aligned < it.length) {
    if (!f.buffered) {
      OpenOptions oo;
      oo.read_only = true;
      auto file = FileSystem::Default()->Open(files_[it.file].path, oo);
      if (!file.ok()) return file.status().WithContext("reshard: " + files_[it.file].context);
      f.buffered = std::move(*file);
    }
    OPTSTATE_RETURN_IF_ERROR(f.buffered->Pread(it.offset + aligned, buf + aligned, it.length - aligned)
                                 .WithContext("reshard: " + files_[it.file].context));
  }
  ++next_;
  return static_cast<const char*>(buf);
}

uint64_t SourceReader::AlignedPart(const FileState& f, const Item& it) const {
  return f.direct->direct() ? it.length / kDirectAlign * kDirectAlign : it.length;
}

void SourceReader::Release(size_t i) {
  const uint32_t fi = items_[i].file;
  if (--left_[fi] == 0) open_[fi] = FileState{};
}

Status SourceReader::Fill() {
  while (!failed_ && submitted_ < items_.size() && submitted_ < next_ + depth_) {
    const Item& it = items_[submitted_];
    FileState& f = open_[it.file];
    if (!f.direct) {
      Status st = Open(it.file);
      if (!st.ok()) {
        failed_ = true;
        failed_item_ = submitted_;
        failed_status_ = std::move(st);
        break;
      }
    }
    Slot& s = slots_[submitted_ % depth_];
    s.done = false;
    s.status = Status::Ok();
    const uint64_t aligned = AlignedPart(f, it);
    if (aligned == 0) {
      s.done = true;
    } else {
      IoRequest r;
      r.op = IoRequest::Op::kRead;
      r.file = f.direct.get();
      r.offset = it.offset;
      r.length = aligned;
      r.buf = s.buf.data();
      r.tag = submitted_ % depth_;
      OPTSTATE_RETURN_IF_ERROR(engine_->Submit({&r, 1}));
    }
    ++submitted_;
  }
  return Status::Ok();
}

Status SourceReader::Open(uint32_t fi) {
  const FieldFile& ff = files_[fi];
  OpenOptions oo;
  oo.read_only = true;
  oo.direct = true;
  auto file = FileSystem::Default()->Open(ff.path, oo);
  if (!file.ok()) return file.status().WithContext("reshard: " + ff.context);
  OPTSTATE_ASSIGN_OR_RETURN(uint64_t size, (*file)->Size());
  if (size != ff.bytes) {
    return Corruption(fmt::format("reshard: {}: size {} bytes, its manifest says {} ({}): {}", ff.path, size,
                                  ff.bytes, ff.context, size < ff.bytes ? "truncated" : "too long"));
  }
  open_[fi].direct = std::move(*file);
  return Status::Ok();
}

DirectWriter::~DirectWriter() { (void)Drain(); }

Status DirectWriter::Init(uint32_t depth, uint64_t buf_bytes, uint32_t streams) {
  depth_ = std::max<uint32_t>(1, depth);
  buf_bytes_ = std::max<uint64_t>(kDirectAlign, (buf_bytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign);
  for (uint32_t i = 0; i < depth_ + streams; ++i) {
    IoBuffer b(buf_bytes_);
    if (!b.ok()) {
      return ResourceExhausted(
          fmt::format("reshard: out of memory for {} write buffers of {} bytes", depth_ + streams, buf_bytes_));
    }
    buffers_.push_back(std::move(b));
    files_.emplace_back();
    free_.push_back(static_cast<int32_t>(i));
  }
  IoEngineOptions eo;
  eo.queue_depth = depth_;
  for (IoBuffer& b : buffers_) eo.registered_buffers.push_back(b.span());  // pinned once, not per write
  OPTSTATE_ASSIGN_OR_RETURN(engine_, NewReshardEngine(std::move(eo), buf_bytes_));
  return Status::Ok();
}

Status DirectWriter::Append(Stream& s, const char* p, uint64_t n) {
  while (n > 0) {
    if (s.buf < 0) {
      OPTSTATE_ASSIGN_OR_RETURN(s.buf, Acquire());
    }
    const uint64_t take = std::min(n, buf_bytes_ - s.fill);
    std::memcpy(reinterpret_cast<char*>(buffers_[s.buf].data()) + s.fill, p, take);
    s.fill += take;
    p += take;
    n -= take;
    if (s.fill == buf_bytes_) OPTSTATE_RETURN_IF_ERROR(Submit(s));
  }
  return Status::Ok();
}

Status DirectWriter::Finish(Stream& s) {
  if (s.buf < 0) return Status::Ok();
  const uint64_t padded = (s.fill + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  std::memset(reinterpret_cast<char*>(buffers_[s.buf].data()) + s.fill, 0, padded - s.fill);
  s.fill = padded;
  return Submit(s);
}

Status DirectWriter::Drain() {
  while (engine_ && engine_->in_flight() > 0) OPTSTATE_RETURN_IF_ERROR(ReapSome());
  return first_error_;
}

Status DirectWriter::Submit(Stream& s) {
  if (s.fill == 0) return Status::Ok();
  while (engine_->in_flight() >= depth_) OPTSTATE_RETURN_IF_ERROR(ReapSome());
  IoRequest r;
  r.op = IoRequest::Op::kWrite;
  r.file = s.file.get();
  r.offset = s.pos;
  r.length = s.fill;
  r.buf = buffers_[s.buf].data();
  r.tag = static_cast<uint64_t>(s.buf);
  OPTSTATE_RETURN_IF_ERROR(engine_->Submit({&r, 1}));
  files_[s.buf] = s.file;
  s.pos += s.fill;
  s.fill = 0;
  s.buf = -1;
  return first_error_;
}

Result<int32_t> DirectWriter::Acquire() {
  while (free_.empty()) {
    if (engine_->in_flight() == 0) return Internal("reshard: more write streams than write buffers");
    OPTSTATE_RETURN_IF_ERROR(ReapSome());
  }
  const int32_t b = free_.back();
  free_.pop_back();
  return b;
}

Status DirectWriter::ReapSome() {
  std::vector<IoCompletion> done;
  OPTSTATE_RETURN_IF_ERROR(engine_->Reap(&done, 1));
  for (IoCompletion& c : done) {
    free_.push_back(static_cast<int32_t>(c.tag));
    files_[c.tag].reset();
    if (!c.status.ok() && first_error_.ok()) first_error_ = std::move(c.status);
  }
  return Status::Ok();
}

}  // namespace optstate::vfs::internal
