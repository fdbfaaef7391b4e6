// libascendserve_xfer.so: the data path of the KV side channel (tcp transport, pull and
// push), a plain C ABI called through ctypes (ascendserve/connectors/transport/native.py).
// No torch, no Python: ctypes releases the GIL for the whole call, so a transfer of any
// size costs its Python thread one GIL acquisition, however many syscalls it takes.
//
// Why: inside a vLLM worker the transfer threads share the GIL with the engine's busy-
// polling loop. Python's socket calls release the GIL around each syscall and must win it
// back after each one; under a spinning thread that took up to a switch interval (5 ms) per
// recvmsg, and a 256 MiB pull ran at a fraction of the same transport outside vLLM.
//
// What moves: "runs", contiguous byte ranges of the KV cache (or of host buffers), in
// transfer order. A structured spec names them without a list: for each base (a layer's
// first page, heads offset applied), for each block id, for each offset inside the page:
// [base + block * block_stride + offset, + run). An explicit spec lists (address, length)
// pairs. Consecutive runs that touch are coalesced; at most kBatch go to one sendmsg /
// recvmsg. The bytes and their order are exactly those of the Python path (tcp.py), so
// either side may run either path.
//
// Deadlines: the socket is driven non-blocking (MSG_DONTWAIT) and waited on with poll():
// no progress for idle_ms, or the whole call past total_ms, fails the call (a dead or
// stalled peer never holds a thread, a hold on P or a staging buffer for longer). A peer that
// closes mid-transfer, or a short payload, fails it at once.

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include <atomic>
#include <climits>
#include <cstdarg>
#include <cstdio>

#define ASV_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kAbiVersion = 2;  // 2: the shm calls take the segment's and the frames' lengths
constexpr int kBatch = 1024;  // iovecs per syscall (Linux IOV_MAX)

// return codes (native.py maps them to Python exceptions)
constexpr int kOk = 0;
constexpr int kOtherHeader = 1;  // fetch: the answer is not the expected header (Python decodes it)
constexpr int kClosed = -1;      // ConnectionError: the peer closed the connection
constexpr int kTimeout = -2;     // TimeoutError: no progress within idle_ms, or past total_ms
constexpr int kOsError = -3;     // OSError(errno)
constexpr int kBadArgs = -4;     // ValueError: a spec that makes no sense

std::atomic<uint64_t> g_sent{0}, g_received{0}, g_calls{0}, g_copied{0};

}  // namespace

// Layout shared with native.py's _Spec (ctypes.Structure): keep in step.
struct AsvSpec {
  const uint64_t* bases;   // structured: n_bases bases; explicit: n_bases addresses
  int64_t n_bases;
  const int64_t* blocks;   // structured only
  int64_t n_blocks;
  int64_t block_stride;
  const int64_t* offsets;  // structured only
  int64_t n_offsets;
  int64_t run;             // structured: bytes per run
  const uint64_t* lens;    // explicit: the length of each address; nullptr: structured
};

namespace {

int64_t spec_bytes(const AsvSpec* s) {
  if (s == nullptr) return 0;
  if (s->lens != nullptr) {
    int64_t total = 0;
    for (int64_t i = 0; i < s->n_bases; ++i) total += static_cast<int64_t>(s->lens[i]);
    return total;
  }
  return s->n_bases * s->n_blocks * s->n_offsets * s->run;
}

bool spec_ok(const AsvSpec* s) {
  if (s == nullptr) return true;
  if (s->n_bases < 0 || (s->n_bases > 0 && s->bases == nullptr)) return false;
  if (s->lens != nullptr) return true;
  return s->n_blocks >= 0 && s->n_offsets >= 0 && s->run >= 0 &&
         (s->n_blocks == 0 || s->blocks != nullptr) && (s->n_offsets == 0 || s->offsets != nullptr);
}

// The runs of a prefix (the frame header sent first) and a spec, in order, coalesced.
class Runs {
 public:
  Runs(const char* prefix, int64_t prefix_len, const AsvSpec* spec) : spec_(spec) {
    if (prefix_len > 0) {
      pending_ = {const_cast<char*>(prefix), static_cast<size_t>(prefix_len)};
      has_pending_ = true;
    }
  }

  // Append runs to iov[n..cap); returns the new count.
  int fill(iovec* iov, int n, int cap) {
    for (;;) {
      if (!has_pending_ && !next(&pending_)) return n;
      has_pending_ = true;
      if (pending_.iov_len == 0) {
        has_pending_ = false;
        continue;
      }
      if (n > 0 && static_cast<char*>(iov[n - 1].iov_base) + iov[n - 1].iov_len == pending_.iov_base) {
        iov[n - 1].iov_len += pending_.iov_len;
      } else if (n < cap) {
        iov[n++] = pending_;
      } else {
        return n;  // kept for the next fill
      }
      has_pending_ = false;
    }
  }

 private:
  bool next(iovec* out) {
    const AsvSpec* s = spec_;
    if (s == nullptr || i_ >= s->n_bases) return false;
    if (s->lens != nullptr) {
      *out = {reinterpret_cast<void*>(s->bases[i_]), static_cast<size_t>(s->lens[i_])};
      ++i_;
      return true;
    }
    if (s->n_blocks == 0 || s->n_offsets == 0) return false;
    const uint64_t addr = s->bases[i_] + static_cast<uint64_t>(s->blocks[j_] * s->block_stride + s->offsets[k_]);
    *out = {reinterpret_cast<void*>(addr), static_cast<size_t>(s->run)};
    if (++k_ == s->n_offsets) {
      k_ = 0;
      if (++j_ == s->n_blocks) {
        j_ = 0;
        ++i_;
      }
    }
    return true;
  }

  const AsvSpec* spec_;
  int64_t i_ = 0, j_ = 0, k_ = 0;
  iovec pending_{nullptr, 0};
  bool has_pending_ = false;
};

int64_t now_ms() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

struct Io {
  int fd;
  bool send;
  int64_t idle_ms, deadline;  // deadline: monotonic ms
  char* err;
  int64_t err_len;
  int64_t done = 0;  // bytes moved by this call

  __attribute__((format(printf, 3, 4))) int fail(int code, const char* fmt, ...) {
    if (err != nullptr && err_len > 0) {
      va_list args;
      va_start(args, fmt);
      vsnprintf(err, static_cast<size_t>(err_len), fmt, args);
      va_end(args);
    }
    return code;
  }

  // Wait until the socket can move bytes: the idle limit, capped by the call's deadline.
  int wait(int64_t total) {
    const int64_t left = deadline - now_ms();
    if (left <= 0) {
      return fail(kTimeout, "KV transfer past its deadline after %lld of %lld bytes",
                  static_cast<long long>(done), static_cast<long long>(total));
    }
    const int64_t limit = left < idle_ms ? left : idle_ms;
    pollfd p{fd, static_cast<short>(send ? POLLOUT : POLLIN), 0};
    int r;
    do {  // poll takes an int: a limit past INT_MAX ms (~24 days) is cut there, never wrapped
      r = poll(&p, 1, static_cast<int>(limit < INT_MAX ? limit : INT_MAX));
    } while (r < 0 && errno == EINTR);
    if (r < 0) return fail(kOsError, "poll failed: %s", strerror(errno));
    if (r == 0 && limit < idle_ms) {
      return fail(kTimeout, "KV transfer past its deadline after %lld of %lld bytes", static_cast<long long>(done),
                  static_cast<long long>(total));
    }
    if (r == 0) {
      return fail(kTimeout, "KV transfer stalled: no progress for %lld ms after %lld of %lld bytes",
                  static_cast<long long>(limit), static_cast<long long>(done), static_cast<long long>(total));
    }
    return kOk;  // readable, writable, or an error/hangup the next call reports
  }

  // Move every run of `runs` (total bytes in all).
  int move(Runs& runs, int64_t total) {
    iovec iov[kBatch];
    int head = 0, n = runs.fill(iov, 0, kBatch);
    while (head < n) {
      msghdr msg{};
      msg.msg_iov = iov + head;
      msg.msg_iovlen = static_cast<size_t>(n - head);
      const ssize_t got = send ? sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL) : recvmsg(fd, &msg, MSG_DONTWAIT);
      if (got < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          const int rc = wait(total);
          if (rc != kOk) return rc;
          continue;
        }
        const int e = errno;
        if (e == EPIPE || e == ECONNRESET) {
          return fail(kClosed, "peer closed the connection mid-transfer (%lld of %lld bytes moved)",
                      static_cast<long long>(done), static_cast<long long>(total));
        }
        return fail(kOsError, "%s failed after %lld of %lld bytes: %s", send ? "send" : "recv",
                    static_cast<long long>(done), static_cast<long long>(total), strerror(e));
      }
      if (got == 0) {  // recv: end of stream (send never returns 0 for a non-empty batch)
        return fail(kClosed, "peer closed the connection mid-transfer (%lld of %lld bytes moved)",
                    static_cast<long long>(done), static_cast<long long>(total));
      }
      done += got;
      if (send) {
        g_sent.fetch_add(static_cast<uint64_t>(got), std::memory_order_relaxed);
      } else {
        g_received.fetch_add(static_cast<uint64_t>(got), std::memory_order_relaxed);
      }
      size_t left = static_cast<size_t>(got);
      while (left > 0 && head < n) {
        if (left >= iov[head].iov_len) {
          left -= iov[head].iov_len;
          ++head;
        } else {
          iov[head].iov_base = static_cast<char*>(iov[head].iov_base) + left;
          iov[head].iov_len -= left;
          left = 0;
        }
      }
      if (n - head < kBatch / 4) {  // refill: keep batches full
        const int rest = n - head;
        memmove(iov, iov + head, sizeof(iovec) * static_cast<size_t>(rest));
        head = 0;
        n = runs.fill(iov, rest, kBatch);
      }
    }
    return kOk;
  }
};

// Receive one frame's prefix and header into `header` (capacity cap): kOk, or kOtherHeader when
// the header does not fit (only the 8-byte prefix read), or a transfer error.
int recv_header(Io& in, char* header, int64_t cap, int64_t* header_len) {
  *header_len = 0;
  const uint64_t prefix_addr[1] = {reinterpret_cast<uint64_t>(header)};
  const uint64_t prefix_len[1] = {8};
  AsvSpec prefix{prefix_addr, 1, nullptr, 0, 0, nullptr, 0, 0, prefix_len};
  Runs p(nullptr, 0, &prefix);
  int rc = in.move(p, 8);
  if (rc != kOk) return rc;
  *header_len = 8;
  const uint8_t* b = reinterpret_cast<const uint8_t*>(header);
  const int64_t body = (int64_t{b[4]} << 24) | (int64_t{b[5]} << 16) | (int64_t{b[6]} << 8) | int64_t{b[7]};
  if (8 + body > cap) return kOtherHeader;
  if (body > 0) {
    const uint64_t body_addr[1] = {reinterpret_cast<uint64_t>(header + 8)};
    const uint64_t body_len[1] = {static_cast<uint64_t>(body)};
    AsvSpec rest{body_addr, 1, nullptr, 0, 0, nullptr, 0, 0, body_len};
    Runs h(nullptr, 0, &rest);
    rc = in.move(h, body);
    if (rc != kOk) return rc;
  }
  *header_len = 8 + body;
  return kOk;
}

bool same(const char* a, int64_t a_len, const char* b, int64_t b_len) {
  return a_len == b_len && memcmp(a, b, static_cast<size_t>(a_len)) == 0;
}

int send_bytes(Io& out, const char* data, int64_t len) {
  Runs r(data, len, nullptr);
  return out.move(r, len);
}

// Bytes of one base's runs (a layer's pages of the spec's blocks).
int64_t layer_bytes(const AsvSpec* s) { return s->n_blocks * s->n_offsets * s->run; }

// Copy base `layer`'s runs to (gather) or from (scatter) `flat`, in transfer order: with a
// repeated block the last copy wins, as on the socket path.
void copy_layer(const AsvSpec* s, int64_t layer, char* flat, bool gather) {
  char* pos = flat;
  const size_t run = static_cast<size_t>(s->run);
  for (int64_t j = 0; j < s->n_blocks; ++j) {
    for (int64_t k = 0; k < s->n_offsets; ++k) {
      char* page = reinterpret_cast<char*>(s->bases[layer] + static_cast<uint64_t>(s->blocks[j] * s->block_stride +
                                                                                    s->offsets[k]));
      if (gather) {
        memcpy(pos, page, run);
      } else {
        memcpy(page, pos, run);
      }
      pos += run;
    }
  }
  g_copied.fetch_add(static_cast<uint64_t>(layer_bytes(s)), std::memory_order_relaxed);
}

int64_t deadline_of(int64_t total_ms) { return now_ms() + (total_ms > 0 ? total_ms : INT64_C(1) << 40); }

}  // namespace

ASV_API int asv_xfer_abi_version(void) { return kAbiVersion; }

// Counters since load: bytes sent, bytes received, calls, bytes copied between pages and a
// shared-memory segment (tests check the path is taken).
ASV_API void asv_xfer_counters(uint64_t* out) {
  out[0] = g_sent.load();
  out[1] = g_received.load();
  out[2] = g_calls.load();
  out[3] = g_copied.load();
}

// Send `prefix` (a frame header; may be empty) then every run of `spec`, or receive every run
// of `spec` (send == 0, no prefix). Returns kOk, kClosed, kTimeout, kOsError or kBadArgs;
// *done: the bytes moved, also on failure; err: a message on failure.
ASV_API int asv_xfer_move(int fd, int send, const char* prefix, int64_t prefix_len, const AsvSpec* spec,
                          int64_t idle_ms, int64_t total_ms, int64_t* done, char* err, int64_t err_len) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  Io io{fd, send != 0, idle_ms > 0 ? idle_ms : 1, deadline_of(total_ms), err, err_len};
  int rc;
  if (fd < 0 || prefix_len < 0 || (prefix_len > 0 && (prefix == nullptr || !send)) || !spec_ok(spec)) {
    rc = io.fail(kBadArgs, "bad transfer arguments");
  } else {
    Runs runs(prefix, prefix_len, spec);
    rc = io.move(runs, prefix_len + spec_bytes(spec));
  }
  if (done != nullptr) *done = io.done;
  return rc;
}

// D's half of a READ in one call: send `request` (the READ frame), receive the answer's
// prefix and header into `header` (capacity header_cap; *header_len its length), and when
// they are byte for byte `expect` (the DATA header of the expected payload) receive the
// payload into `spec`'s runs: kOk. Any other answer (ERR, another payload size, or another
// encoding of the same header by another version): kOtherHeader with no payload byte read,
// for the caller to decode; a header longer than the capacity leaves only the 8-byte prefix.
ASV_API int asv_xfer_fetch(int fd, const char* request, int64_t request_len, const char* expect,
                           int64_t expect_len, char* header, int64_t header_cap, int64_t* header_len,
                           const AsvSpec* spec, int64_t idle_ms, int64_t total_ms, int64_t* done, char* err,
                           int64_t err_len) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t deadline = deadline_of(total_ms);
  idle_ms = idle_ms > 0 ? idle_ms : 1;
  if (done != nullptr) *done = 0;
  if (header_len != nullptr) *header_len = 0;
  if (fd < 0 || request_len < 0 || (request_len > 0 && request == nullptr) || expect == nullptr || expect_len < 8 ||
      header == nullptr || header_len == nullptr || header_cap < 8 || !spec_ok(spec)) {
    Io io{fd, true, idle_ms, deadline, err, err_len};
    return io.fail(kBadArgs, "bad fetch arguments");
  }
  if (request_len > 0) {
    Io out{fd, true, idle_ms, deadline, err, err_len};
    Runs req(request, request_len, nullptr);
    const int rc = out.move(req, request_len);
    if (rc != kOk) return rc;
  }
  Io in{fd, false, idle_ms, deadline, err, err_len};
  int rc = recv_header(in, header, header_cap, header_len);
  if (rc != kOk) return rc;
  if (!same(header, *header_len, expect, expect_len)) return kOtherHeader;
  in.done = 0;  // the payload's bytes from here
  Runs payload(nullptr, 0, spec);
  rc = in.move(payload, spec_bytes(spec));
  if (done != nullptr) *done = in.done;
  return rc;
}

// ---- shm: the pages go through a shared-memory segment, the frames through the socket ----------
// The segment (seg_len bytes) holds a read layer-major: layer l's pages at seg + l * layer_bytes,
// each page's runs in transfer order (spec: one base per layer, every layer, the read's blocks and
// heads). `frames` (frames_len bytes) holds the LAYER frames of layers 0..n-1 back to back, frame l
// ending at frame_ends[l].

namespace {

// The checks both sides make before a byte moves: a structured spec whose layers fit the segment,
// frames that lie inside `frames`, and the buffers the answer needs.
bool shm_args_ok(int fd, const AsvSpec* spec, const char* seg, int64_t seg_len, const char* frames,
                 int64_t frames_len, const int64_t* frame_ends, const char* done, int64_t done_len,
                 const char* header, int64_t header_cap, const int64_t* header_len) {
  if (fd < 0 || spec == nullptr || spec->lens != nullptr || !spec_ok(spec) || seg == nullptr || seg_len < 0 ||
      header == nullptr || header_len == nullptr || header_cap < 8 || done_len < 0 ||
      (done_len > 0 && done == nullptr) || frames_len < 0) {
    return false;
  }
  if (spec->n_bases > 0 && (frames == nullptr || frame_ends == nullptr)) return false;
  const int64_t per_layer = layer_bytes(spec);
  if (per_layer < 0 || (per_layer > 0 && spec->n_bases > seg_len / per_layer)) return false;
  int64_t start = 0;
  for (int64_t l = 0; l < spec->n_bases; ++l) {
    if (frame_ends[l] < start || frame_ends[l] > frames_len) return false;
    start = frame_ends[l];
  }
  return true;
}

}  // namespace

// P: gather layer l into the segment and send its LAYER frame, for every layer (D copies layer l
// out while layer l + 1 is copied in), then receive D's answer: kOk when it is byte for byte
// `done` (the DONE frame), else kOtherHeader with it in `header`. kBadArgs, nothing written, when
// the layers do not fit the segment or a frame lies outside `frames`.
ASV_API int asv_xfer_shm_serve(int fd, const AsvSpec* spec, char* seg, int64_t seg_len, const char* frames,
                               int64_t frames_len, const int64_t* frame_ends, const char* done, int64_t done_len,
                               char* header, int64_t header_cap, int64_t* header_len, int64_t idle_ms,
                               int64_t total_ms, char* err, int64_t err_len) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  idle_ms = idle_ms > 0 ? idle_ms : 1;
  const int64_t deadline = deadline_of(total_ms);
  Io out{fd, true, idle_ms, deadline, err, err_len};
  if (header_len != nullptr) *header_len = 0;
  if (!shm_args_ok(fd, spec, seg, seg_len, frames, frames_len, frame_ends, done, done_len, header, header_cap,
                   header_len)) {
    return out.fail(kBadArgs, "bad shm serve arguments (a read larger than its segment?)");
  }
  const int64_t per_layer = layer_bytes(spec);
  int64_t start = 0;
  for (int64_t l = 0; l < spec->n_bases; ++l) {
    copy_layer(spec, l, seg + l * per_layer, true);
    const int rc = send_bytes(out, frames + start, frame_ends[l] - start);
    if (rc != kOk) return rc;
    start = frame_ends[l];
  }
  Io in{fd, false, idle_ms, deadline, err, err_len};
  const int rc = recv_header(in, header, header_cap, header_len);
  if (rc != kOk) return rc;
  return same(header, *header_len, done, done_len) ? kOk : kOtherHeader;
}

// D: for each layer receive its LAYER frame (byte for byte frames' l-th) and scatter the layer
// from the segment into the pages, then send `done`: kOk. A frame that differs: kOtherHeader,
// *layers_done = its layer, the frame in `header` (nothing of it copied), for the caller.
// kBadArgs, nothing read, when the layers do not fit the segment or a frame lies outside `frames`.
ASV_API int asv_xfer_shm_fetch(int fd, const AsvSpec* spec, const char* seg, int64_t seg_len, const char* frames,
                               int64_t frames_len, const int64_t* frame_ends, const char* done, int64_t done_len,
                               char* header, int64_t header_cap, int64_t* header_len, int64_t* layers_done,
                               int64_t idle_ms, int64_t total_ms, char* err, int64_t err_len) {
  g_calls.fetch_add(1, std::memory_order_relaxed);
  idle_ms = idle_ms > 0 ? idle_ms : 1;
  const int64_t deadline = deadline_of(total_ms);
  Io in{fd, false, idle_ms, deadline, err, err_len};
  if (header_len != nullptr) *header_len = 0;
  if (layers_done != nullptr) *layers_done = 0;
  if (layers_done == nullptr || !shm_args_ok(fd, spec, seg, seg_len, frames, frames_len, frame_ends, done, done_len,
                                             header, header_cap, header_len)) {
    return in.fail(kBadArgs, "bad shm fetch arguments (a read larger than its segment?)");
  }
  const int64_t per_layer = layer_bytes(spec);
  int64_t start = 0;
  for (int64_t l = 0; l < spec->n_bases; ++l) {
    const int rc = recv_header(in, header, header_cap, header_len);
    if (rc != kOk) return rc;
    if (!same(header, *header_len, frames + start, frame_ends[l] - start)) return kOtherHeader;
    copy_layer(spec, l, const_cast<char*>(seg) + l * per_layer, false);
    start = frame_ends[l];
    *layers_done = l + 1;
  }
  Io out{fd, true, idle_ms, deadline, err, err_len};
  return send_bytes(out, done, done_len);
}
