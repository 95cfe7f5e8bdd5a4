// Restoring a checkpoint into a new store whose Adam moments (the fields
// exp_avg and exp_avg_sq) have another dtype than the checkpoint's: what
// `optstate-restore --create NAME --moments f32|bf16` runs.
//
// The checkpoint's manifest is parsed and validated as for any restore, and
// every chunk of every field file is checked against the manifest's size and
// XXH3 before its bytes are used. Moments are converted element by element:
// f32 -> bf16 rounds to nearest even (relative error <= 2^-8 per element),
// bf16 -> f32 is exact, so f32 -> bf16 -> f32 is within 2^-8 of the
// original; f32 -> q8 quantizes per block of 256 (error <= half the map's
// gap x the block's absmax, <= 0.0071 x absmax), q8 -> f32 decodes exactly
// (map[code] x absmax). Every other field (main) is copied bit for bit. The new store
// gets the manifest's tensors (fields re-typed), step, groups and step counts
// as one committed generation. On any error the new store directory is
// removed (nothing else is touched).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "base/status.h"
#include "vfs/store.h"

namespace optstate::tools {

// True for the fields that hold Adam moments.
bool IsMomentField(std::string_view field);

// Creates a store at store_path (which must not exist) from the checkpoint
// directory dir with moments stored as `moments` (q8: q8s exp_avg, q8u
// exp_avg_sq and their absmax fields; quantized with the step's quantizer,
// kernels::Q8Quantize). opts as for
// Store::Create (its chunk_size_bytes is replaced by the manifest's).
// progress (may be empty): (bytes of field files done, total).
Result<std::unique_ptr<vfs::Store>> CreateStoreWithMoments(const std::string& dir, const std::string& store_path,
                                                           vfs::StoreOptions opts, MomentDType moments,
                                                           const std::function<void(uint64_t, uint64_t)>& progress);

}  // namespace optstate::tools
