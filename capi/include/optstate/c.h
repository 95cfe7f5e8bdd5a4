/* optstate C ABI: liboptstate.so, for Python (ctypes) and any trainer that
 * cannot link C++.
 *
 * A thin wrapper of the public C++ headers (vfs/store.h,
 * memmgr/memory_manager.h, memmgr/streamed_adam.h, kernels/adam.h): opaque
 * handles, optstate_* names, no C++ type crosses it.
 *
 * Errors. Every call that can fail returns an optstate_code (OPTSTATE_OK = 0,
 * else the code of the failure) and takes `char** errptr` last. On failure
 * *errptr is set to a malloc'ed, NUL-terminated message naming the thing
 * (store path, tensor, field, chunk, generation, errno text) that the caller
 * releases with optstate_free(); a message already in *errptr is freed first
 * (google/leveldb include/leveldb/c.h). On success *errptr is left alone.
 * errptr may be NULL when the caller only wants the code.
 *
 * Ownership and lifetime. Each create or open call returns a handle the caller
 * destroys with the matching destroy or close call, in any order: a store
 * closed while managers or optimizers made on it are open is closed when the
 * last of them is destroyed, and a manager destroyed while optimizers made
 * with it are open is destroyed with the last of them (so a garbage collector
 * may finalise the handles in any order); the handle must not be used after
 * its close or destroy call either way. Destroying an optimizer writes and
 * commits steps held only in the host cache (durable_every_steps > 1).
 *
 * Pointers. Gradients, parameter copies, initial values and found-inf flags
 * are device pointers on the cuda backend and host pointers on the host
 * backend (optstate_mm_backend says which). On cuda, a gradient must be
 * complete before optstate_adam_step_with is called (synchronise the stream that
 * produced it); parameter copies are complete when it returns.
 *
 * Thread-safety: a store handle may be used from any thread; an optimizer is
 * driven by one thread at a time (it is not thread-safe).
 *
 * Versioning: OPTSTATE_C_ABI_VERSION grows with every addition to this
 * header (a function, a struct, a field appended to a struct that carries
 * its struct_size, an enum value); optstate_abi_version() is the library's,
 * so a caller checks optstate_abi_version() >= OPTSTATE_C_ABI_VERSION at load
 * time to know that everything it was built against is there. Nothing
 * declared here is removed or changes its signature, layout or meaning: a
 * change in behaviour or options gets a new function (e.g.
 * optstate_checkpoint_restore2 next to optstate_checkpoint_restore, whose
 * signature stays), so callers of the old one keep building and linking
 * against liboptstate.so.1.
 * Version 2 is the first that promises every declaration below; a library
 * that reports 1 may lack any call but those of its first release. Version 3
 * adds the update rules (optstate_adam_options_set_rule,
 * optstate_adam_set_group_hyper, optstate_adam_get_group_hyper,
 * optstate_adam_fields). Version 4 adds Muon and several rules in one
 * optimizer (the rule "muon", optstate_adam_options_add_rule,
 * optstate_adam_register_params_with). Version 5 adds
 * optstate_checkpoint_export_with (a checkpoint without state.safetensors).
 * Version 6 adds optstate_checkpoint_reshard_with (resharded checkpoints
 * without state.safetensors), optstate_checkpoint_export_args_t's optimizer
 * (an export from the optimizer's host cache tier) and
 * optstate_checkpoint_export2 with optstate_checkpoint_export_result_t. */
#ifndef OPTSTATE_C_H_
#define OPTSTATE_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(OPTSTATE_C_BUILD)
#define OPTSTATE_EXPORT __attribute__((visibility("default")))
#else
#define OPTSTATE_EXPORT
#endif

#define OPTSTATE_C_ABI_VERSION 6

/* Codes: the values of optstate::StatusCode (base/status.h; the library checks
 * these copies against it when it is built). */
typedef enum optstate_code {
  OPTSTATE_OK = 0,
  OPTSTATE_INVALID_ARGUMENT = 1,    /* bad input from the caller */
  OPTSTATE_NOT_FOUND = 2,           /* store, tensor, field, snapshot missing */
  OPTSTATE_ALREADY_EXISTS = 3,
  OPTSTATE_FAILED_PRECONDITION = 4, /* wrong state: pins outstanding, poisoned, ... */
  OPTSTATE_BUSY = 5,                /* the store is open in another process or handle */
  OPTSTATE_RESOURCE_EXHAUSTED = 6,  /* budget, memlock, fds */
  OPTSTATE_NO_SPACE = 7,
  OPTSTATE_IO_ERROR = 8,
  OPTSTATE_CORRUPTION = 9,          /* checksum mismatch, damaged store */
  OPTSTATE_DATA_LOSS = 10,          /* acknowledged data is gone (failed fsync) */
  OPTSTATE_CANCELLED = 11,
  OPTSTATE_UNIMPLEMENTED = 12,
  OPTSTATE_INTERNAL = 13
} optstate_code;

/* Element types: the values of optstate::DType (base/dtype.h; the library
 * checks these copies against it when it is built); OPTSTATE_NONE
 * (optstate::kernels::kNoDTypeCode) where a tensor is not given. Gradients, parameter
 * copies and initial values are F32, BF16 or F16; Q8S and Q8U are the 8-bit
 * codes of q8 moment fields (optstate_pin_dtype of such a field). */
typedef enum optstate_dtype {
  OPTSTATE_F32 = 0,
  OPTSTATE_BF16 = 1,
  OPTSTATE_F16 = 2,
  OPTSTATE_Q8S = 3,
  OPTSTATE_Q8U = 4,
  OPTSTATE_NONE = 255
} optstate_dtype;

typedef struct optstate_store_options_t optstate_store_options_t;
typedef struct optstate_store_t optstate_store_t;
typedef struct optstate_snapshot_list_t optstate_snapshot_list_t;
typedef struct optstate_mm_options_t optstate_mm_options_t;
typedef struct optstate_mm_t optstate_mm_t;
typedef struct optstate_adam_options_t optstate_adam_options_t;
typedef struct optstate_adam_t optstate_adam_t;
typedef struct optstate_pin_t optstate_pin_t;

/* ---- library ---- */

/* "MAJOR.MINOR.PATCH" of the library; static storage. */
OPTSTATE_EXPORT const char* optstate_version(void);
/* OPTSTATE_C_ABI_VERSION the library was built with. */
OPTSTATE_EXPORT int optstate_abi_version(void);
/* Name of a code ("InvalidArgument", ...); static storage. */
OPTSTATE_EXPORT const char* optstate_code_name(int code);
/* Frees a message or any other buffer this library returned. */
OPTSTATE_EXPORT void optstate_free(void* ptr);
/* Sets the level of the library's log (stderr, process-wide): "trace",
 * "debug", "info", "warn", "error" or "off"; another name is INVALID_ARGUMENT
 * and changes nothing. The level starts as the environment variable
 * OPTSTATE_LOG_LEVEL says, else "info". */
OPTSTATE_EXPORT int optstate_set_log_level(const char* level, char** errptr);

/* ---- store (vfs::Store) ---- */

OPTSTATE_EXPORT optstate_store_options_t* optstate_store_options_create(void);
OPTSTATE_EXPORT void optstate_store_options_destroy(optstate_store_options_t* opts);
/* Create only. Default: the directory's base name. */
OPTSTATE_EXPORT void optstate_store_options_set_name(optstate_store_options_t* opts, const char* name);
/* Create only. A multiple of 2 MiB. Default 8 MiB. */
OPTSTATE_EXPORT void optstate_store_options_set_chunk_size_bytes(optstate_store_options_t* opts,
                                                                 uint64_t bytes);
/* Create only. Adds a data directory (one per NVMe drive); default <path>/data. */
OPTSTATE_EXPORT void optstate_store_options_add_data_dir(optstate_store_options_t* opts, const char* dir);
/* Committed generations kept besides snapshots and leases (>= 1). Default 1. */
OPTSTATE_EXPORT void optstate_store_options_set_retained_generations(optstate_store_options_t* opts,
                                                                     uint32_t n);
/* O_DIRECT data files (nonzero, default) or buffered. */
OPTSTATE_EXPORT void optstate_store_options_set_direct_io(optstate_store_options_t* opts, int on);
/* Create only. The training job (lineage) the store belongs to: every rank of
 * one job passes the same id (written to each checkpoint's manifest as "job";
 * a reshard refuses checkpoints of different jobs). At most 256 bytes, no
 * control characters. Default (NULL or ""): a new uuid, a job of its own. */
OPTSTATE_EXPORT void optstate_store_options_set_job(optstate_store_options_t* opts, const char* job);

/* Creates a store at path (must not exist, or be an empty directory that becomes the store; its parent
   must exist). opts may be NULL. */
OPTSTATE_EXPORT int optstate_store_create(const char* path, const optstate_store_options_t* opts,
                                          optstate_store_t** out, char** errptr);
/* Opens an existing store read-write. In use elsewhere: OPTSTATE_BUSY naming the holder. */
OPTSTATE_EXPORT int optstate_store_open(const char* path, const optstate_store_options_t* opts,
                                        optstate_store_t** out, char** errptr);
/* Closes the store (NULL is a no-op) and releases its lock; with managers or
 * optimizers still open on it, when the last of them is destroyed. */
OPTSTATE_EXPORT void optstate_store_close(optstate_store_t* store);

/* Identity, valid while the store is open. */
OPTSTATE_EXPORT const char* optstate_store_path(const optstate_store_t* store);
OPTSTATE_EXPORT const char* optstate_store_name(const optstate_store_t* store);
OPTSTATE_EXPORT const char* optstate_store_uuid(const optstate_store_t* store);
/* The store's job id; "" for a store created before stores recorded one. */
OPTSTATE_EXPORT const char* optstate_store_job(const optstate_store_t* store);
OPTSTATE_EXPORT uint64_t optstate_store_chunk_size_bytes(const optstate_store_t* store);

/* The newest committed generation and the trainer step recorded with it. */
OPTSTATE_EXPORT void optstate_store_latest_generation(const optstate_store_t* store, uint64_t* generation,
                                                      uint64_t* step);
/* Step count of a group in the newest committed generation (0 when unknown). */
OPTSTATE_EXPORT uint64_t optstate_store_group_step_count(const optstate_store_t* store, uint32_t group);

/* Reads elements [first, first + count) of a tensor field of the newest
 * committed generation into out (host memory, count fp32 values; bf16 and
 * f16 fields, e.g. bf16 moments, are decoded exactly; q8 moments decode to
 * map[code] x their block's absmax, the values the step uses). Fields: "main",
 * "exp_avg", "exp_avg_sq" (and with q8 moments "exp_avg.absmax",
 * "exp_avg_sq.absmax": one scale per 256 elements). Every chunk read is
 * checksum-verified. */
OPTSTATE_EXPORT int optstate_store_read_field(optstate_store_t* store, const char* tensor, const char* field,
                                              uint64_t first, uint64_t count, float* out, char** errptr);
/* numel of a tensor (NOT_FOUND naming near names when absent). */
OPTSTATE_EXPORT int optstate_store_tensor_numel(const optstate_store_t* store, const char* tensor,
                                                uint64_t* numel, char** errptr);

/* The names of the store's tensors (committed, and created in the pending generation), sorted: each
 * followed by a NUL in *names, *size_bytes bytes in all (0 and NULL for none); freed with optstate_free(). */
OPTSTATE_EXPORT int optstate_store_tensor_names(const optstate_store_t* store, char** names, size_t* size_bytes,
                                                char** errptr);

/* Snapshots of the newest committed generation (an O(1) metadata write;
 * create first waits for the in-flight commit of an optimizer's last step). */
OPTSTATE_EXPORT int optstate_store_snapshot_create(optstate_store_t* store, const char* name,
                                                   uint64_t* generation, char** errptr);
OPTSTATE_EXPORT int optstate_store_snapshot_release(optstate_store_t* store, const char* name, char** errptr);
OPTSTATE_EXPORT int optstate_store_snapshot_list(const optstate_store_t* store, optstate_snapshot_list_t** out,
                                                 char** errptr);
OPTSTATE_EXPORT size_t optstate_snapshot_list_count(const optstate_snapshot_list_t* list);
/* REQUIRES: i < count. Valid until the list is destroyed. */
OPTSTATE_EXPORT const char* optstate_snapshot_list_name(const optstate_snapshot_list_t* list, size_t i);
OPTSTATE_EXPORT uint64_t optstate_snapshot_list_generation(const optstate_snapshot_list_t* list, size_t i);
OPTSTATE_EXPORT void optstate_snapshot_list_destroy(optstate_snapshot_list_t* list);

typedef struct optstate_store_stats_t {
  uint64_t latest_generation;
  uint64_t live_bytes;              /* logical bytes of written chunks in latest */
  uint64_t referenced_extent_bytes; /* disk space of every retained version */
  uint64_t pending_bytes;           /* written in the uncommitted generation */
  uint64_t lifetime_bytes_written;
  uint64_t generations_retained;
  uint64_t snapshots;
  uint64_t leases;
} optstate_store_stats_t;
OPTSTATE_EXPORT int optstate_store_stats(const optstate_store_t* store, optstate_store_stats_t* out,
                                         char** errptr);

/* ---- checkpoint directories (vfs/checkpoint.h) ---- */

/* Writes a committed generation of the store as a checkpoint directory at
 * dest: byte for byte what optstate-mount shows for it (manifest.json,
 * state.safetensors, tensors/<tensor>/<field>), which optstate-restore and
 * optstate_checkpoint_restore take. snapshot: the snapshot to write, or NULL
 * for the newest committed generation (held by a reader lease while it is
 * written, so GC keeps it; the in-flight commit of the last step of each
 * optimizer open on the store is waited for first, so it is that step's
 * state: call it from the thread that drives the optimizer, or while none
 * steps). Every chunk is verified as it is read; the bytes
 * never pass through the caller. The directory is written as
 * "<dest>.partial-XXXXXXXX", fsynced and renamed to dest when complete, so
 * dest is complete or absent (a crash may leave the .partial directory).
 * dest must not exist or be an empty directory (ALREADY_EXISTS); its parent
 * must exist. *generation (may be NULL) = the generation written. */
OPTSTATE_EXPORT int optstate_checkpoint_export(optstate_store_t* store, const char* snapshot, const char* dest,
                                               uint64_t* generation, char** errptr);
/* What optstate_checkpoint_export_with writes.
 *   snapshot: the snapshot to write, or NULL for the newest committed
 *     generation (as optstate_checkpoint_export's).
 *   flags: OPTSTATE_EXPORT_NO_SAFETENSORS leaves state.safetensors out: it
 *     holds every field file's bytes again, so the default checkpoint is
 *     twice the state, twice the bytes to write. Without it the
 *     directory holds manifest.json (marked "state_safetensors": false) and
 *     the field files; optstate_checkpoint_restore reads the field files
 *     either way, each chunk checked against the manifest. Other bits:
 *     INVALID_ARGUMENT.
 * Zero-initialise it, set struct_size = sizeof(optstate_checkpoint_export_args_t)
 * as the caller was built, then the fields. Fields are only ever appended,
 * and the library reads only those that fit in struct_size. Since ABI
 * version 5. */
#define OPTSTATE_EXPORT_NO_SAFETENSORS 1u
/*   optimizer (since ABI version 6): NULL, or an optimizer open on the
 *     store: each chunk whose copy in its host cache tier holds the exported
 *     generation's bytes (checked against the chunk's checksum, as a disk
 *     read is) is written from RAM, and only the others are read from the
 *     disk. The files are the same either way. An optimizer of another
 *     store: INVALID_ARGUMENT. */
typedef struct optstate_checkpoint_export_args_t {
  size_t struct_size;
  const char* snapshot;
  uint64_t flags;
  optstate_adam_t* optimizer;
} optstate_checkpoint_export_args_t;
/* optstate_checkpoint_export with the options in args (NULL: the defaults,
 * which are optstate_checkpoint_export's). Since ABI version 5. */
OPTSTATE_EXPORT int optstate_checkpoint_export_with(optstate_store_t* store, const char* dest,
                                                    const optstate_checkpoint_export_args_t* args,
                                                    uint64_t* generation, char** errptr);
/* What an export did (optstate_checkpoint_export2). Set struct_size =
 * sizeof(optstate_checkpoint_export_result_t) as the caller was built: the
 * library writes only the fields that fit in it. Chunks never written (zeros)
 * are counted neither from RAM nor from disk. Since ABI version 6.
 *   generation: the generation written. files, bytes: written, all files.
 *   ram_chunks, ram_bytes: field chunks (logical bytes) taken from the
 *     optimizer's host cache tier.
 *   disk_chunks, disk_bytes: field chunks (logical bytes) read from the
 *     store's data files.
 *   ram_mismatch_chunks: chunks the tier held with other bytes than the
 *     generation's (a newer step), read from the disk instead. */
typedef struct optstate_checkpoint_export_result_t {
  size_t struct_size;
  uint64_t generation;
  uint64_t files;
  uint64_t bytes;
  uint64_t ram_chunks;
  uint64_t ram_bytes;
  uint64_t disk_chunks;
  uint64_t disk_bytes;
  uint64_t ram_mismatch_chunks;
} optstate_checkpoint_export_result_t;
/* optstate_checkpoint_export_with that says what it did in *result (may be
 * NULL). Since ABI version 6. */
OPTSTATE_EXPORT int optstate_checkpoint_export2(optstate_store_t* store, const char* dest,
                                                const optstate_checkpoint_export_args_t* args,
                                                optstate_checkpoint_export_result_t* result, char** errptr);
/* Imports the checkpoint directory src into the store as one new committed
 * generation, with the checkpoint's step, step counts and hyperparameters.
 * Verifies manifest.json's own checksum, every chunk of every file against
 * the manifest's XXH3 and the checkpoint's layout against the store's tensors
 * (a difference is INVALID_ARGUMENT listing each tensor and field that
 * differs; damage is CORRUPTION naming the file and chunk); on any error
 * nothing is committed. A checkpoint of another store and job (its manifest's
 * store uuid and job differ from the store's) into a store whose newest generation has taken steps is
 * FAILED_PRECONDITION unless flags has OPTSTATE_RESTORE_FORCE. When the store's
 * newest generation has taken steps it is kept as a snapshot
 * "pre-restore-<generation>-<unix ms>" before the import (released again if
 * the restore fails), so no state is dropped.
 * REQUIRES: no memory manager or optimizer is open on the store
 * (FAILED_PRECONDITION naming the store otherwise; destroy them first: a new
 * optimizer resumes from the restored generation).
 * *generation (may be NULL) = the new generation; *kept_snapshot (may be
 * NULL) = the name of the snapshot kept, malloc'ed (optstate_free), or NULL
 * when none was made. */
#define OPTSTATE_RESTORE_FORCE 1u
OPTSTATE_EXPORT int optstate_checkpoint_restore2(optstate_store_t* store, const char* src, uint32_t flags,
                                                 uint64_t* generation, char** kept_snapshot, char** errptr);
/* Makes snapshot `snapshot` of the store its head again, in O(chunks changed
 * since the snapshot) metadata and no data copy (vfs/store.h
 * Store::RevertToSnapshot): a new committed generation whose tensors, chunk
 * versions, per-group and per-tensor step counts, hyperparameters and step
 * are the snapshot's; the head it replaces is kept as a snapshot
 * "pre-revert-<generation>-<unix ms>" in the same synced batch. A snapshot of
 * the head itself changes nothing. NOT_FOUND for an unknown snapshot;
 * FAILED_PRECONDITION while the store holds a tensor created after the
 * snapshot or uncommitted writes.
 * REQUIRES: no memory manager or optimizer is open on the store
 * (FAILED_PRECONDITION naming the store otherwise; a new optimizer resumes
 * from the reverted head).
 * *generation (may be NULL) = the new head; *kept_snapshot (may be NULL) =
 * the name of the snapshot kept, malloc'ed (optstate_free), or NULL when
 * none was made. */
OPTSTATE_EXPORT int optstate_store_revert(optstate_store_t* store, const char* snapshot, uint64_t* generation,
                                          char** kept_snapshot, char** errptr);
/* optstate_checkpoint_restore2 with no flags and no kept_snapshot. */
OPTSTATE_EXPORT int optstate_checkpoint_restore(optstate_store_t* store, const char* src, uint64_t* generation,
                                                char** errptr);

/* Reshards the checkpoint directories of N ranks (sources[0..num_sources),
 * any order) into M ranks' (vfs/reshard.h, docs/RESHARD.md): layout_json is
 * the target layout (format "optstate-reshard-layout"); the sources must tile
 * every global tensor exactly once and agree on step, generation, groups and
 * fields, and the layout must tile the same tensors (INVALID_ARGUMENT naming
 * the tensor and the ranges otherwise; nothing is written). Every source
 * chunk is verified as it is read (CORRUPTION naming the file and chunk).
 * Writes dest/rank-00000 ... all or nothing ("<dest>.partial-XXXXXXXX",
 * fsynced, renamed); each is a checkpoint optstate_checkpoint_restore takes.
 * dest must not exist or be an empty directory. *ranks (may be NULL) = the
 * ranks written. */
OPTSTATE_EXPORT int optstate_checkpoint_reshard(const char* const* sources, size_t num_sources,
                                                const char* layout_json, const char* dest, uint32_t* ranks,
                                                char** errptr);
/* What optstate_checkpoint_reshard_with writes.
 *   flags: OPTSTATE_RESHARD_NO_SAFETENSORS leaves state.safetensors out of
 *     every rank's directory (it holds the field files' bytes again, so the
 *     default writes twice the state): manifest.json (marked
 *     "state_safetensors": false) and the field files, which
 *     optstate_checkpoint_restore reads alone. Other bits: INVALID_ARGUMENT.
 * Zero-initialise it, set struct_size =
 * sizeof(optstate_checkpoint_reshard_args_t) as the caller was built, then
 * the fields (appended only, as optstate_checkpoint_export_args_t's). Since
 * ABI version 6. */
#define OPTSTATE_RESHARD_NO_SAFETENSORS 1u
typedef struct optstate_checkpoint_reshard_args_t {
  size_t struct_size;
  uint64_t flags;
} optstate_checkpoint_reshard_args_t;
/* optstate_checkpoint_reshard with the options in args (NULL: the defaults,
 * which are optstate_checkpoint_reshard's). Since ABI version 6. */
OPTSTATE_EXPORT int optstate_checkpoint_reshard_with(const char* const* sources, size_t num_sources,
                                                     const char* layout_json, const char* dest,
                                                     const optstate_checkpoint_reshard_args_t* args,
                                                     uint32_t* ranks, char** errptr);
/* A target layout that splits every tensor of the sources evenly over `ranks`
 * ranks by split rules, separated by commas or newlines, the first whose
 * pattern matches a tensor's name wins: "[PATTERN=]KIND", PATTERN a glob
 * (fnmatch, default "*"), KIND rows (dimension 0), columns (the last
 * dimension; 1-D tensors along dimension 0), dimN or flat (even flat ranges
 * of the row-major flattening). NULL = "rows". A tensor no rule matches, or a
 * rule with a pattern that matches no tensor, is INVALID_ARGUMENT.
 * *layout_json: the JSON, released with optstate_free(). */
OPTSTATE_EXPORT int optstate_checkpoint_reshard_layout(const char* const* sources, size_t num_sources,
                                                       uint32_t ranks, const char* split, char** layout_json,
                                                       char** errptr);

/* ---- memory manager (memmgr::MemoryManager) ---- */

OPTSTATE_EXPORT optstate_mm_options_t* optstate_mm_options_create(void);
OPTSTATE_EXPORT void optstate_mm_options_destroy(optstate_mm_options_t* opts);
/* "auto" (default: cuda when a device is visible), "host" or "cuda". */
OPTSTATE_EXPORT int optstate_mm_options_set_backend(optstate_mm_options_t* opts, const char* backend,
                                                    char** errptr);
/* Hard cap on device pages for state, bytes. Default 2 GiB. */
OPTSTATE_EXPORT void optstate_mm_options_set_device_budget_bytes(optstate_mm_options_t* opts, uint64_t bytes);
/* Pinned host cache tier (RAM as a read tier: steps read the chunks it
 * holds from RAM and write every generation through to disk), bytes; 0 = off.
 * Default OPTSTATE_HOST_CACHE_AUTO: half of MemAvailable, leaving at least
 * 4 GiB free, divided among the node's ranks (LOCAL_WORLD_SIZE), one budget
 * shared by every manager of the process that uses it; see
 * memmgr/memory_manager.h MemoryManagerOptions::host_cache_bytes. */
#define OPTSTATE_HOST_CACHE_AUTO UINT64_MAX
OPTSTATE_EXPORT void optstate_mm_options_set_host_cache_bytes(optstate_mm_options_t* opts, uint64_t bytes);
/* Chunk slices the step pipeline stages at once (staging buffers: 3n + 4);
 * 0 = auto (default: enough to keep the I/O queues full, fewer when the
 * state's slices cannot use them: the pool grows with the state). */
OPTSTATE_EXPORT void optstate_mm_options_set_read_ahead_chunks(optstate_mm_options_t* opts, uint32_t n);
/* CUDA device ordinal (cuda backend). Default 0. */
OPTSTATE_EXPORT void optstate_mm_options_set_cuda_device(optstate_mm_options_t* opts, int device);

/* opts may be NULL (defaults). */
OPTSTATE_EXPORT int optstate_mm_create(optstate_store_t* store, const optstate_mm_options_t* opts,
                                       optstate_mm_t** out, char** errptr);
/* Destroys the manager (NULL is a no-op); with optimizers made with it still
 * open, when the last of them is destroyed. */
OPTSTATE_EXPORT void optstate_mm_destroy(optstate_mm_t* mm);
/* "host" or "cuda"; static storage. */
OPTSTATE_EXPORT const char* optstate_mm_backend(const optstate_mm_t* mm);
/* Sleep: writes dirty chunks back and releases every device page
 * (FAILED_PRECONDITION while ranges are pinned). Waking is free: the next
 * step or pin maps pages again. */
OPTSTATE_EXPORT int optstate_mm_release_all(optstate_mm_t* mm, char** errptr);

typedef struct optstate_mm_stats_t {
  uint64_t resident_bytes;      /* device pages in use now */
  uint64_t peak_resident_bytes; /* max since creation; <= budget_bytes */
  uint64_t budget_bytes;
  uint64_t nvme_read_bytes;
  uint64_t nvme_write_bytes;
  uint64_t cache_hit_bytes;
  uint64_t cache_bytes;
  uint64_t h2d_bytes;
  uint64_t d2h_bytes;
  double io_stall_seconds;
  uint64_t pins;
  uint64_t evictions;
} optstate_mm_stats_t;
OPTSTATE_EXPORT void optstate_mm_stats(const optstate_mm_t* mm, optstate_mm_stats_t* out);

/* Waits until every unpinned dirty chunk (written through a WRITE or
 * READ_WRITE pin) is written to the store's pending generation. Durability and
 * publication are a commit's (optstate_adam_commit). */
OPTSTATE_EXPORT int optstate_mm_flush(optstate_mm_t* mm, char** errptr);

/* ---- pinned ranges (memmgr::MemoryManager::Pin) ---- */

typedef enum optstate_access {
  OPTSTATE_ACCESS_READ = 0,       /* contents loaded; never written back */
  OPTSTATE_ACCESS_WRITE = 1,      /* contents undefined until written; written back on unpin */
  OPTSTATE_ACCESS_READ_WRITE = 2  /* contents loaded; written back on unpin */
} optstate_access;

/* Pins elements [first, first + count) of a tensor field ("main",
 * "exp_avg", "exp_avg_sq"): the whole chunks that hold the range become
 * resident within the device budget (loaded from the newest state unless
 * OPTSTATE_ACCESS_WRITE) and stay at a stable address until optstate_unpin.
 * A range larger than the budget fails at once (RESOURCE_EXHAUSTED); one that
 * does not fit yet waits for other pins to be released (a thread that holds
 * pins and asks for more than the rest of the budget deadlocks itself).
 * While a range of a param is pinned, a step over that param fails
 * (FAILED_PRECONDITION, nothing committed), and so does
 * optstate_mm_release_all. Writing through a READ pin is undefined: the bytes
 * are never stored and later pins may see them. */
OPTSTATE_EXPORT int optstate_pin(optstate_mm_t* mm, const char* tensor, const char* field, uint64_t first,
                                 uint64_t count, int access, optstate_pin_t** out, char** errptr);
/* Device pointer (host pointer on the host backend) of element `first`;
 * NULL once the pin's manager was destroyed. */
OPTSTATE_EXPORT void* optstate_pin_data(const optstate_pin_t* pin);
OPTSTATE_EXPORT uint64_t optstate_pin_count(const optstate_pin_t* pin);
OPTSTATE_EXPORT uint64_t optstate_pin_size_bytes(const optstate_pin_t* pin);
/* Element type of the field (optstate_dtype). */
OPTSTATE_EXPORT int optstate_pin_dtype(const optstate_pin_t* pin);
/* The cudaStream_t the contents are ready on, or NULL (host backend, or
 * already synchronised when optstate_pin returned). */
OPTSTATE_EXPORT void* optstate_pin_stream(const optstate_pin_t* pin);
/* Releases the pin and frees the handle, also when it fails (the error is
 * then that of scheduling the write-back). WRITE and READ_WRITE ranges are
 * written back to the pending generation (optstate_mm_flush waits for it)
 * and published by the next commit. NULL is a no-op. Pins still held when
 * their manager is destroyed are released by optstate_mm_destroy; the
 * handles must still be freed with optstate_unpin. */
OPTSTATE_EXPORT int optstate_unpin(optstate_pin_t* pin, char** errptr);

/* ---- streamed Adam / AdamW (memmgr::StreamedAdam) ---- */

OPTSTATE_EXPORT optstate_adam_options_t* optstate_adam_options_create(void);
OPTSTATE_EXPORT void optstate_adam_options_destroy(optstate_adam_options_t* opts);
/* Gradients are multiplied by 1/grad_scale. Default 1. */
OPTSTATE_EXPORT void optstate_adam_options_set_grad_scale(optstate_adam_options_t* opts, float grad_scale);
/* CPU threads of the host backend's kernel. Default 1. */
OPTSTATE_EXPORT void optstate_adam_options_set_cpu_threads(optstate_adam_options_t* opts, int threads);
/* Commit every N-th step when the host cache holds the whole state. Default 1. */
OPTSTATE_EXPORT void optstate_adam_options_set_durable_every_steps(optstate_adam_options_t* opts, uint32_t n);
/* Steps whose commit may still run when a step returns: 0 = a step returns
 * once its generation is committed; 1 = once its kernels and param copies
 * are done, the commit completing in the background until the next call
 * (step, make_durable, commit, registration, load_main, pin, release_all,
 * destroy), which waits for it and returns its error if it failed (the
 * optimizer is then back at the last commit). Default 1 (docs/STREAMED_ADAM.md,
 * "Pipelined commits"); other values: INVALID_ARGUMENT at optstate_adam_create. */
OPTSTATE_EXPORT void optstate_adam_options_set_commit_lag_steps(optstate_adam_options_t* opts, uint32_t n);
OPTSTATE_EXPORT uint32_t optstate_adam_options_commit_lag_steps(const optstate_adam_options_t* opts);
/* Storage dtype of exp_avg and exp_avg_sq: "f32" (default; 12 bytes per param
 * per step each way with the fp32 main), "bf16" (8 bytes; decoded, updated
 * in fp32, rounded to nearest even: relative error <= 2^-8 per store) or "q8"
 * (~6.03 bytes: 8-bit codes with one fp32 absmax per 256 elements; error per
 * store <= half the quantization map's gap x the block's absmax;
 * docs/MOMENTS.md). Chosen
 * when a store's params are first registered and recorded in the store; an
 * optimizer created with the other dtype on that store fails at
 * optstate_adam_create (INVALID_ARGUMENT naming the store, tensor, field and
 * both dtypes). Another name: INVALID_ARGUMENT here, options unchanged. */
OPTSTATE_EXPORT int optstate_adam_options_set_moment_dtype(optstate_adam_options_t* opts, const char* dtype,
                                                           char** errptr);

/* The update rule of the optimizer: "adamw" (default: exp_avg and
 * exp_avg_sq), "lion" (Lion, Chen et al. 2023: one moment, exp_avg), "sgd"
 * (SGD with momentum as torch.optim.SGD: one momentum_buffer), "sgd_plain"
 * (SGD without momentum: main only, and a group with momentum is
 * INVALID_ARGUMENT) or, since ABI version 4, "muon" (Muon as
 * torch.optim.Muon: one momentum_buffer; each param a 2-D matrix, stepped
 * whole: the device budget must hold the largest one's fields and
 * Newton-Schulz scratch, else RESOURCE_EXHAUSTED naming it). The moment dtype applies to the rule's state fields
 * (f32 or bf16; q8 is adamw's alone: INVALID_ARGUMENT at optstate_adam_create).
 * A store keeps the fields of the rule its params were registered with; an
 * optimizer of another rule on it fails at optstate_adam_create naming the
 * store, tensor and field. Another name: INVALID_ARGUMENT, options unchanged.
 * Since ABI version 3. */
OPTSTATE_EXPORT int optstate_adam_options_set_rule(optstate_adam_options_t* opts, const char* rule, char** errptr);
/* Several rules in one optimizer (e.g. "muon" for the matrices and "adamw"
 * for the rest): each call appends a rule, its index the number of rules
 * added before it; once any is added they replace the rule of
 * optstate_adam_options_set_rule. A param's rule is chosen at registration
 * (optstate_adam_register_params_with; the other registration calls take rule
 * 0). moment_dtype: its state fields' dtype as
 * optstate_adam_options_set_moment_dtype's ("q8": adamw only), NULL = the
 * options' moment dtype. Two rules with the same fields (e.g. "sgd" and
 * "muon") are INVALID_ARGUMENT at optstate_adam_create. A group's
 * hyperparameters are the union of its rules' names (a name two rules share,
 * e.g. lr and weight_decay of muon and adamw, has one value); muon's
 * are lr, weight_decay (decoupled), momentum, nesterov, ns_steps, ns_a,
 * ns_b, ns_c (Newton-Schulz coefficients), ns_eps (the norm's floor:
 * torch.optim.Muon's eps) and adjust_lr_fn (0 "original", 1
 * "match_rms_adamw", 2 "spectral_unclamped"). A stored param keeps the rule
 * whose fields it has. Another name: INVALID_ARGUMENT, options unchanged.
 * Since ABI version 4. */
OPTSTATE_EXPORT int optstate_adam_options_add_rule(optstate_adam_options_t* opts, const char* rule,
                                                   const char* moment_dtype, char** errptr);

/* On a store that already holds tensors, their state, groups and step counts
 * are restored (resume). opts may be NULL. */
OPTSTATE_EXPORT int optstate_adam_create(optstate_store_t* store, optstate_mm_t* mm,
                                         const optstate_adam_options_t* opts, optstate_adam_t** out,
                                         char** errptr);
OPTSTATE_EXPORT void optstate_adam_destroy(optstate_adam_t* adam);

/* Adds or updates a group's hyperparameters; they apply from the next step.
 * adamw nonzero: decoupled weight decay (AdamW); zero: L2 (Adam). On an
 * optimizer of another rule (lion, sgd, sgd_plain) FAILED_PRECONDITION naming
 * the rule: use optstate_adam_set_group_hyper. */
OPTSTATE_EXPORT int optstate_adam_set_group(optstate_adam_t* adam, uint32_t group, double lr, double beta1,
                                            double beta2, double eps, double weight_decay, int adamw,
                                            char** errptr);
/* The group's hyperparameters as the optimizer holds them (restored from the
 * store on resume). Any output pointer may be NULL. On an optimizer of
 * another rule (lion, sgd, sgd_plain) FAILED_PRECONDITION naming the rule:
 * its hyperparameters are read with optstate_adam_get_group_hyper. */
OPTSTATE_EXPORT int optstate_adam_get_group(const optstate_adam_t* adam, uint32_t group, double* lr,
                                            double* beta1, double* beta2, double* eps, double* weight_decay,
                                            int* adamw, char** errptr);

/* A group's hyperparameters by the rule's names; they apply from the next
 * step. adamw: lr, beta1, beta2, eps, weight_decay, adamw (nonzero:
 * decoupled); lion: lr, beta1, beta2, weight_decay (decoupled); sgd and
 * sgd_plain: lr, momentum, dampening, weight_decay (L2), nesterov, maximize
 * (nonzero: true); muon: see optstate_adam_options_add_rule. n names and values; a name the rule lacks or an invalid
 * value is INVALID_ARGUMENT (nothing changes), a name not given takes the
 * rule's default. Since ABI version 3. */
OPTSTATE_EXPORT int optstate_adam_set_group_hyper(optstate_adam_t* adam, uint32_t group, size_t n,
                                                  const char* const* names, const double* values, char** errptr);
/* A group's hyperparameters as the optimizer holds them (restored from the
 * store on resume): *n names, back to back, each followed by a NUL, in *names,
 * and their values in *values; both malloc'ed (optstate_free). Since ABI
 * version 3. */
OPTSTATE_EXPORT int optstate_adam_get_group_hyper(const optstate_adam_t* adam, uint32_t group, char** names,
                                                  double** values, size_t* n, char** errptr);
/* The fields the rules keep per tensor (each once), "main" first: *n names, each followed
 * by a NUL, in *names (malloc'ed, optstate_free). Since ABI version 3. */
OPTSTATE_EXPORT int optstate_adam_fields(const optstate_adam_t* adam, char** names, size_t* n, char** errptr);

/* Registers a parameter shard and returns its id (*id, for optstate_adam_step_with).
 * initial: numel elements of initial_dtype (f32/bf16/f16) that become the fp32
 * main; NULL = zeros. shape: ndim extents whose product is numel (NULL/0 =
 * {numel}). When the store already holds the param (resume) its state is kept,
 * initial is ignored and *existed is set to 1 (else 0; existed may be NULL). */
OPTSTATE_EXPORT int optstate_adam_register_param(optstate_adam_t* adam, const char* name, uint64_t numel,
                                                 uint32_t group, const void* initial, int initial_dtype,
                                                 const uint64_t* shape, size_t ndim, uint32_t* id,
                                                 int* existed, char** errptr);
/* optstate_adam_register_param for a shard of a larger tensor (tensor or
 * data parallelism), recorded for optstate_checkpoint_reshard:
 * global_shape[global_ndim] is the whole tensor's shape and
 * shard_offset[offset_ndim] where the shard lies in it: a box (offset_ndim =
 * global_ndim = ndim) or, with ndim = offset_ndim = 1 and a higher
 * global_ndim, the flat range [shard_offset[0], shard_offset[0] + numel) of
 * the tensor's row-major flattening. global_ndim 0 = the shard is the whole
 * tensor (as optstate_adam_register_param). A stored param registered with
 * another geometry is INVALID_ARGUMENT. */
OPTSTATE_EXPORT int optstate_adam_register_shard(optstate_adam_t* adam, const char* name, uint64_t numel,
                                                 uint32_t group, const void* initial, int initial_dtype,
                                                 const uint64_t* shape, size_t ndim, const uint64_t* global_shape,
                                                 size_t global_ndim, const uint64_t* shard_offset,
                                                 size_t offset_ndim, uint32_t* id, int* existed, char** errptr);
/* Registers n params in one call (a model of thousands of small tensors:
 * one call, their initial mains written with many writes in flight); per
 * param i as optstate_adam_register_shard with names[i], numels[i],
 * groups[i], initials[i] (initials may be NULL: all zeros) of
 * initial_dtypes[i], and shape, global shape and shard offset of ndims[i],
 * global_ndims[i] and offset_ndims[i] extents, taken in order from the
 * concatenated arrays shapes, global_shapes and shard_offsets (any ndims
 * array may be NULL: all 0). ids[i] and existed[i] (existed may be NULL) as
 * there. Every registration is checked before any is made: an error names
 * the param and nothing changes (a name given twice is INVALID_ARGUMENT). */
OPTSTATE_EXPORT int optstate_adam_register_params(optstate_adam_t* adam, size_t n, const char* const* names,
                                                  const uint64_t* numels, const uint32_t* groups,
                                                  const void* const* initials, const int* initial_dtypes,
                                                  const size_t* ndims, const uint64_t* shapes,
                                                  const size_t* global_ndims, const uint64_t* global_shapes,
                                                  const size_t* offset_ndims, const uint64_t* shard_offsets,
                                                  uint32_t* ids, int* existed, char** errptr);
/* A registration of n params (optstate_adam_register_params_with): the
 * arrays of optstate_adam_register_params, one entry per param, and
 *   rules: rules[i] the index of param i's rule (optstate_adam_options_add_rule;
 *     NULL = all 0). A param the store holds under another rule, an index
 *     past the rules, or a shape the rule cannot step (a "muon" param that is
 *     not 2-D; its shape, none = {numel}) is INVALID_ARGUMENT naming the
 *     param, and nothing is registered.
 *   ids (out, n entries), existed (out, may be NULL): as
 *     optstate_adam_register_params's.
 * Zero-initialise it, set struct_size = sizeof(optstate_adam_register_args_t)
 * as the caller was built, then the fields; NULL arrays are "not given". Fields
 * are only ever appended, and the library reads only those that fit in
 * struct_size. Since ABI version 4. */
typedef struct optstate_adam_register_args_t {
  size_t struct_size;
  size_t n;
  const char* const* names;
  const uint64_t* numels;
  const uint32_t* groups;
  const uint32_t* rules;
  const void* const* initials;
  const int* initial_dtypes;
  const size_t* ndims;
  const uint64_t* shapes;
  const size_t* global_ndims;
  const uint64_t* global_shapes;
  const size_t* offset_ndims;
  const uint64_t* shard_offsets;
  uint32_t* ids;
  int* existed;
} optstate_adam_register_args_t;
OPTSTATE_EXPORT int optstate_adam_register_params_with(optstate_adam_t* adam,
                                                       const optstate_adam_register_args_t* args, char** errptr);
/* numel of a registered param (NOT_FOUND otherwise). */
OPTSTATE_EXPORT int optstate_adam_param_numel(const optstate_adam_t* adam, uint32_t id, uint64_t* numel,
                                              char** errptr);

/* One step's inputs (optstate_adam_step_with). Zero-initialise it, set
 * struct_size, then the fields a step needs; NULL pointers are "not given".
 *   n, ids, grads, grad_dtypes: n params, ids[i] from register_param and
 *     grads[i] of grad_dtypes[i] (F32, BF16 or F16). Registered params not
 *     listed keep their state.
 *   numels: the elements of grads[i] (and params[i]); each is checked against
 *     the param's registered numel before anything runs, so a model that no
 *     longer matches its store fails with INVALID_ARGUMENT naming the param and
 *     nothing is committed. NULL = the caller guarantees the registered numels.
 *   params, param_dtypes: the model copy params[i] of param_dtypes[i], updated
 *     in the same pass (params NULL: no copies; an entry may be NULL with
 *     OPTSTATE_NONE).
 *   found_inf: a float flag; nonzero skips the step (nothing changes, nothing
 *     is committed).
 *   grad_scale: a pointer to this step's gradient scale, one float (e.g.
 *     torch's GradScaler scale tensor): the step divides the grads by it, for
 *     this step only, without a host synchronisation. It must be finite and
 *     > 0, else INVALID_ARGUMENT and nothing changes; it is read after
 *     found_inf, so a skipped step never reads it. NULL = the optimizer's
 *     standing scale (optstate_adam_set_grad_scale).
 * found_inf and grad_scale are device pointers on the cuda backend, host
 * pointers on host. struct_size = sizeof(optstate_adam_step_args_t) as the
 * caller was built: fields are only ever appended, and the library reads only
 * those that fit in struct_size (less than the fields above, those of ABI
 * version 2: INVALID_ARGUMENT). */
typedef struct optstate_adam_step_args_t {
  size_t struct_size;
  size_t n;
  const uint32_t* ids;
  const void* const* grads;
  const int* grad_dtypes;
  const uint64_t* numels;
  void* const* params;
  const int* param_dtypes;
  const float* found_inf;
  const float* grad_scale;
} optstate_adam_step_args_t;

/* The step: one pass over the listed params (see optstate_adam_step_args_t).
 * Commits one generation unless skipped. On error nothing is committed and
 * the last committed state stays. */
OPTSTATE_EXPORT int optstate_adam_step_with(optstate_adam_t* adam, const optstate_adam_step_args_t* args,
                                            char** errptr);
/* Sets the optimizer's standing gradient scale (grads are divided by it in
 * every step that passes no grad_scale of its own); it starts as the
 * grad_scale option. Finite and > 0, else INVALID_ARGUMENT and nothing
 * changes. */
OPTSTATE_EXPORT int optstate_adam_set_grad_scale(optstate_adam_t* adam, float grad_scale, char** errptr);

/* Thin wrappers kept for callers of earlier versions; new code calls
 * optstate_adam_step_with.
 * optstate_adam_step: optstate_adam_set_grad_scale(grad_scale) when
 * grad_scale > 0 (0 keeps the standing scale; negative or non-finite:
 * INVALID_ARGUMENT, nothing changes), then a step of n params with no numels
 * and no per-step scale.
 * optstate_adam_step2: a step with numels and this step's grad_scale pointer,
 * as the fields of optstate_adam_step_args_t. */
OPTSTATE_EXPORT int optstate_adam_step(optstate_adam_t* adam, size_t n, const uint32_t* ids,
                                       const void* const* grads, const int* grad_dtypes, void* const* params,
                                       const int* param_dtypes, const float* found_inf, float grad_scale,
                                       char** errptr);
OPTSTATE_EXPORT int optstate_adam_step2(optstate_adam_t* adam, size_t n, const uint32_t* ids,
                                        const void* const* grads, const int* grad_dtypes, const uint64_t* numels,
                                        void* const* params, const int* param_dtypes, const float* found_inf,
                                        const float* grad_scale, char** errptr);
/* Leaves a param the store holds, but this run's model no longer has, out of
 * the run: its state stays in the store, unchanged in every later generation,
 * and it is never stepped. Once a run registered params, a step fails
 * (FAILED_PRECONDITION naming them) while the store holds a param this run
 * neither registered nor retired. NOT_FOUND when the store has no such param;
 * FAILED_PRECONDITION when it is registered in this run. */
OPTSTATE_EXPORT int optstate_adam_retire_param(optstate_adam_t* adam, const char* name, char** errptr);
/* Whether the last step was skipped by found_inf. */
OPTSTATE_EXPORT int optstate_adam_last_step_skipped(const optstate_adam_t* adam);
/* Seconds the last step took inside the library (the pipeline and its
 * commit): what a caller's own per-step overhead is measured against. */
OPTSTATE_EXPORT double optstate_adam_last_step_seconds(const optstate_adam_t* adam);

/* Starts reading the next step's state into the host cache tier in the
 * background and returns at once: call it when forward/backward starts, so
 * that the next step finds the state in RAM instead of reading it from disk
 * (docs/STREAMED_ADAM.md, "Prefetch"). A hint: it changes no result and
 * fails only when the optimizer is unusable; a second call while one runs,
 * or a call without a host cache tier, does nothing. The next step,
 * make_durable, commit, registration, load_main, retire and destroy stop it
 * (keeping what it read); pin and release_all wait for it to end. */
OPTSTATE_EXPORT int optstate_adam_prefetch(optstate_adam_t* adam, char** errptr);
/* The last step's prefetch: *hit_bytes, the chunk bytes the step found in
 * the host cache tier because a prefetch read them there; *read_bytes, the
 * bytes the prefetches before the step read. Either pointer may be NULL. */
OPTSTATE_EXPORT void optstate_adam_last_step_prefetch(const optstate_adam_t* adam, uint64_t* hit_bytes,
                                                      uint64_t* read_bytes);

/* Replaces a param's fp32 main from model weights (numel elements of dtype),
 * e.g. after the model's weights were loaded separately. Moments are kept. */
OPTSTATE_EXPORT int optstate_adam_load_main(optstate_adam_t* adam, uint32_t id, const void* weights, int dtype,
                                            char** errptr);
/* Writes and commits steps held only in the host cache; *generation = the
 * newest committed generation (may be NULL). */
OPTSTATE_EXPORT int optstate_adam_make_durable(optstate_adam_t* adam, uint64_t* generation, char** errptr);

/* Commits everything pending as one generation: steps held only in the host
 * cache, registrations, loaded mains, and chunks written through pinned
 * ranges (the manager is flushed first). A commit of pinned writes alone
 * records the trainer step and the step counts of the last commit (a write
 * through a pin is not a training step). Ranges still pinned are not part of
 * it. *generation = the newest committed generation (unchanged when nothing
 * was pending; may be NULL). On error nothing is committed. */
OPTSTATE_EXPORT int optstate_adam_commit(optstate_adam_t* adam, uint64_t* generation, char** errptr);

/* Steps in which any param of the group stepped (0 for an unknown group). */
OPTSTATE_EXPORT uint64_t optstate_adam_step_count(const optstate_adam_t* adam, uint32_t group);
/* *out = the param's own step count (torch's state[p]["step"]): the steps it
 * had a gradient in, as its bias correction counts them; steps not yet
 * committed included. NOT_FOUND for a name that is not a param of this run
 * (registered or restored from the store, not retired). */
OPTSTATE_EXPORT int optstate_adam_param_step_count(const optstate_adam_t* adam, const char* name, uint64_t* out,
                                                   char** errptr);
OPTSTATE_EXPORT uint64_t optstate_adam_last_generation(const optstate_adam_t* adam);
/* The trainer step recorded with the last commit; the next commit records +1. */
OPTSTATE_EXPORT uint64_t optstate_adam_global_step(const optstate_adam_t* adam);
OPTSTATE_EXPORT void optstate_adam_set_global_step(optstate_adam_t* adam, uint64_t step);
/* Steps taken since the last commit (0 unless durable_every_steps > 1). */
OPTSTATE_EXPORT uint64_t optstate_adam_uncommitted_steps(const optstate_adam_t* adam);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* OPTSTATE_C_H_ */
