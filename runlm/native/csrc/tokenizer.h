// runlm kernels: SentencePiece BPE encoding for the native runtime's tokenizer (runlm.text.spm), and the walk over a
// GGUF vocabulary's string lengths (runlm.formats.gguf).
// A part of kernels.cpp's one translation unit, included in order (the C library build only).
//
// GGUF's 'llama' tokenizer model stores pieces and scores, no merges. runlm.text.tokenizer turns them into the merge
// list transformers' converter writes (every split of a piece into two pieces, best-ranked piece first, then the longer
// left part, then the longer right part, then the piece's place in the vocabulary) for the `tokenizers` library;
// building that list and the library's tables for Gemma's 262k pieces took most of a model's load. Here the rank of a
// pair is computed when the pair meets, from the same four keys, so nothing is built but one hash table of the
// pieces: the same ids as the `tokenizers` backend (the tests compare both), at a few milliseconds of load.
//
// An encode: the text is cut at the added tokens (leftmost, longest first, as `tokenizers` matches them; a special
// token read as text stays in its piece), each piece between them normalized (spaces become U+2581, with a dummy
// prefix where the model adds one) and cut into characters, a character outside the vocabulary into its <0xNN> byte
// pieces (else the unknown piece, runs of them fused), and the best-ranked adjacent pair merged until none is left
// (ties: the leftmost).
#ifdef RUNLM_STANDALONE
#include <cstdio>
#include <memory>
#include <queue>
#include <string_view>
#include <unordered_map>

namespace {

constexpr std::string_view kMeta = "\xE2\x96\x81";  // U+2581, SentencePiece's space

enum SpmPrefix : int64_t { kPrefixNone = 0, kPrefixEachPiece = 1, kPrefixFirstPiece = 2 };
enum SpmFlags : int64_t { kSpecialsAsText = 1, kAfterSpecial = 2 };

uint64_t spm_hash(std::string_view s) {  // FNV-1a
  uint64_t h = 1469598103934665603ull;
  for (const unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

struct SpmTokenizer {
  std::string blob;              // every piece's bytes, one after another
  std::vector<int64_t> start;    // piece i is blob[start[i], start[i + 1])
  std::vector<int32_t> slots;    // open addressing: a piece's id (its last one where a piece repeats), or -1
  uint64_t mask = 0;
  int64_t distinct = 0;
  std::vector<double> score;     // by id: the ranking of the merge that makes this piece
  std::vector<int32_t> first;    // by id: where the piece first appears (a tie's order)
  std::vector<int32_t> chars;    // by id: the piece's length in characters
  int32_t byte_id[256];
  int32_t unk = -1;
  int64_t prefix = kPrefixNone;
  // added tokens: a byte trie, node 0 the root; terminal[node] = the token's id, or -1
  std::unordered_map<uint64_t, int32_t> edges;
  std::vector<int32_t> terminal{-1};
  std::vector<uint8_t> special{0};
  bool starts_added[256] = {};

  std::string_view piece(int32_t id) const {
    return std::string_view(blob).substr(start[id], start[id + 1] - start[id]);
  }

  // The slot that holds `s`, or the empty one where it would go.
  uint64_t slot_of(std::string_view s) const {
    uint64_t i = spm_hash(s) & mask;
    while (slots[i] >= 0 && piece(slots[i]) != s) i = (i + 1) & mask;
    return i;
  }

  int32_t lookup(std::string_view s) const { return slots[slot_of(s)]; }
};

int32_t utf8_chars(std::string_view s) {
  int32_t n = 0;
  for (const unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

size_t utf8_length(unsigned char lead) {
  return lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
}

struct SpmMerge {
  double score;
  int32_t left_chars, right_chars, first, pos, id;
  // true where `other` merges first: the better-ranked pair, then the leftmost
  bool operator<(const SpmMerge& o) const {
    if (score != o.score) return score < o.score;
    if (left_chars != o.left_chars) return left_chars < o.left_chars;
    if (right_chars != o.right_chars) return right_chars < o.right_chars;
    if (first != o.first) return first > o.first;
    return pos > o.pos;
  }
};

struct SpmSymbol {
  int32_t id, prev, next;
  bool alive;
};

// The piece two adjacent pieces make, as a merge ranked for the queue; false where the vocabulary has none.
bool spm_pair(const SpmTokenizer& t, int32_t left, int32_t right, int32_t pos, std::string& scratch, SpmMerge* out) {
  const std::string_view a = t.piece(left), b = t.piece(right);
  if (a.empty() || b.empty()) return false;
  scratch.assign(a);
  scratch.append(b);
  const int32_t id = t.lookup(scratch);
  if (id < 0) return false;
  *out = SpmMerge{t.score[id], t.chars[left], t.chars[right], t.first[id], pos, id};
  return true;
}

// One normalized piece of text -> ids, appended to `out`.
void spm_word(const SpmTokenizer& t, std::string_view text, std::vector<int32_t>& out) {
  std::vector<SpmSymbol> symbols;
  symbols.reserve(text.size());
  int32_t unk_pending = 0;  // a run of unknown characters, added at the next known one (as `tokenizers` does)
  auto add = [&](int32_t id) {
    const int32_t at = static_cast<int32_t>(symbols.size());
    symbols.push_back(SpmSymbol{id, at - 1, at + 1, true});
  };
  for (size_t i = 0; i < text.size();) {
    const size_t n = std::min(utf8_length(static_cast<unsigned char>(text[i])), text.size() - i);
    const int32_t id = t.lookup(text.substr(i, n));
    if (id >= 0) {
      if (unk_pending) add(t.unk), unk_pending = 0;
      add(id);
    } else {
      bool bytes = true;
      for (size_t j = i; j < i + n; ++j) bytes = bytes && t.byte_id[static_cast<unsigned char>(text[j])] >= 0;
      if (bytes) {
        for (size_t j = i; j < i + n; ++j) add(t.byte_id[static_cast<unsigned char>(text[j])]);
      } else if (t.unk >= 0) {
        unk_pending = 1;
      }
    }
    i += n;
  }
  if (unk_pending) add(t.unk);
  if (symbols.empty()) return;
  symbols.back().next = -1;

  std::priority_queue<SpmMerge> queue;
  std::string scratch;
  SpmMerge m;
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i)
    if (spm_pair(t, symbols[i].id, symbols[i + 1].id, i, scratch, &m)) queue.push(m);
  while (!queue.empty()) {
    const SpmMerge top = queue.top();
    queue.pop();
    SpmSymbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    const SpmSymbol right = symbols[left.next];
    if (!spm_pair(t, left.id, right.id, top.pos, scratch, &m) || m.id != top.id) continue;  // a stale pair
    symbols[left.next].alive = false;
    left.id = top.id;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0 && spm_pair(t, symbols[left.prev].id, left.id, left.prev, scratch, &m)) queue.push(m);
    if (left.next >= 0 && spm_pair(t, left.id, symbols[left.next].id, top.pos, scratch, &m)) queue.push(m);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
}

// A piece of text between added tokens: normalized, then encoded.
void spm_text(const SpmTokenizer& t, std::string_view text, bool at_start, int64_t flags, std::string& normalized,
              std::vector<int32_t>& out) {
  if (text.empty()) return;
  normalized.clear();
  for (const char c : text) {
    if (c == ' ') normalized.append(kMeta);
    else normalized.push_back(c);
  }
  const bool prepend = t.prefix == kPrefixEachPiece ||
                       (t.prefix == kPrefixFirstPiece && at_start && !(flags & kAfterSpecial) &&
                        normalized.compare(0, kMeta.size(), kMeta) != 0);
  if (prepend) normalized.insert(0, kMeta);
  spm_word(t, normalized, out);
}

void spm_encode(const SpmTokenizer& t, std::string_view text, int64_t flags, std::vector<int32_t>& out) {
  std::string normalized;
  size_t piece_start = 0, pos = 0;
  while (pos < text.size()) {
    if (t.starts_added[static_cast<unsigned char>(text[pos])]) {
      int32_t node = 0, found = -1;
      size_t found_end = 0;
      for (size_t j = pos; j < text.size(); ++j) {
        const auto it = t.edges.find(static_cast<uint64_t>(node) << 8 | static_cast<unsigned char>(text[j]));
        if (it == t.edges.end()) break;
        node = it->second;
        if (t.terminal[node] >= 0) found = node, found_end = j + 1;
      }
      if (found >= 0) {
        if (!((flags & kSpecialsAsText) && t.special[found])) {
          spm_text(t, text.substr(piece_start, pos - piece_start), piece_start == 0, flags, normalized, out);
          out.push_back(t.terminal[found]);
          piece_start = found_end;
        }
        pos = found_end;
        continue;
      }
    }
    ++pos;
  }
  spm_text(t, text.substr(piece_start), piece_start == 0, flags, normalized, out);
}

}  // namespace

extern "C" {

// A tokenizer of `n` pieces (blob: their UTF-8 bytes, each ended by a NUL; scores: the ranking of the merge making
// each), its byte pieces and unknown piece found by name; prefix: SpmPrefix. Returns null (rl_last_error says why).
void* rl_spm_new(const char* blob, int64_t blob_bytes, int64_t n, const double* scores, int64_t prefix) {
  SpmTokenizer* made = nullptr;
  const int rc = guarded([&] {
    RUNLM_CHECK(n > 0 && n < (int64_t{1} << 31), "a vocabulary of ", n, " pieces");
    RUNLM_CHECK(prefix >= kPrefixNone && prefix <= kPrefixFirstPiece, "unknown prefix rule ", prefix);
    auto t = std::make_unique<SpmTokenizer>();
    t->blob.reserve(blob_bytes);
    t->start.reserve(n + 1);
    for (int64_t at = 0, i = 0; i < n; ++i) {
      const char* end = static_cast<const char*>(memchr(blob + at, 0, blob_bytes - at));
      RUNLM_CHECK(end != nullptr, "the vocabulary's bytes hold ", i, " pieces, not ", n);
      t->start.push_back(static_cast<int64_t>(t->blob.size()));
      t->blob.append(blob + at, end - (blob + at));
      at = end - blob + 1;
    }
    RUNLM_CHECK(t->blob.size() + n == static_cast<size_t>(blob_bytes), "the vocabulary's bytes hold more than ", n,
                " pieces (a piece with a NUL in it?)");
    t->start.push_back(static_cast<int64_t>(t->blob.size()));
    t->score.assign(scores, scores + n);  // a repeated piece: the last one's score (and its first one's place)
    t->first.resize(n);
    t->chars.resize(n);
    uint64_t size = 1024;
    while (size < 2 * static_cast<uint64_t>(n)) size *= 2;
    t->slots.assign(size, -1);
    t->mask = size - 1;
    for (int32_t i = 0; i < n; ++i) {
      const uint64_t slot = t->slot_of(t->piece(i));
      const int32_t before = t->slots[slot];
      t->first[i] = before >= 0 ? t->first[before] : i;
      t->distinct += before < 0;
      t->slots[slot] = i;
      t->chars[i] = utf8_chars(t->piece(i));
    }
    char name[8];
    for (int b = 0; b < 256; ++b) {
      snprintf(name, sizeof name, "<0x%02X>", b);
      t->byte_id[b] = t->lookup(name);
    }
    t->prefix = prefix;
    made = t.release();
  });
  return rc == 0 ? made : nullptr;
}

// Adds a token matched whole in text (special: one that encoding with kSpecialsAsText reads as text instead).
int rl_spm_add_token(void* handle, const char* text, int64_t bytes, int64_t id, int64_t special) {
  return guarded([&] {
    SpmTokenizer& t = *static_cast<SpmTokenizer*>(handle);
    RUNLM_CHECK(bytes > 0 && id >= 0 && id < static_cast<int64_t>(t.chars.size()), "an added token must have text and "
                "an id in the vocabulary");
    int32_t node = 0;
    for (int64_t i = 0; i < bytes; ++i) {
      const auto [it, added] = t.edges.try_emplace(static_cast<uint64_t>(node) << 8 | static_cast<uint8_t>(text[i]),
                                                  static_cast<int32_t>(t.terminal.size()));
      if (added) t.terminal.push_back(-1), t.special.push_back(0);
      node = it->second;
    }
    t.terminal[node] = static_cast<int32_t>(id);
    t.special[node] = special != 0;
    t.starts_added[static_cast<uint8_t>(text[0])] = true;
  });
}

int rl_spm_set_unknown(void* handle, int64_t id) {
  return guarded([&] {
    SpmTokenizer& t = *static_cast<SpmTokenizer*>(handle);
    RUNLM_CHECK(id >= -1 && id < static_cast<int64_t>(t.chars.size()), "unknown piece id ", id, " out of range");
    t.unk = static_cast<int32_t>(id);
  });
}

void rl_spm_free(void* handle) { delete static_cast<SpmTokenizer*>(handle); }

// How many distinct pieces the vocabulary has.
int64_t rl_spm_size(void* handle) {
  return static_cast<const SpmTokenizer*>(handle)->distinct;
}

// The id of a piece spelled `text`, or -1.
int64_t rl_spm_piece_id(void* handle, const char* text, int64_t bytes) {
  return static_cast<const SpmTokenizer*>(handle)->lookup(std::string_view(text, bytes));
}

// For each of n ids: 1 where the vocabulary finds that piece's spelling at that id (not at a later repeat), else 0.
int rl_spm_own_ids(void* handle, const int64_t* ids, int64_t n, uint8_t* out) {
  return guarded([&] {
    const SpmTokenizer& t = *static_cast<const SpmTokenizer*>(handle);
    for (int64_t i = 0; i < n; ++i) {
      RUNLM_CHECK(ids[i] >= 0 && ids[i] < static_cast<int64_t>(t.chars.size()), "piece id ", ids[i], " out of range");
      out[i] = t.lookup(t.piece(static_cast<int32_t>(ids[i]))) == ids[i];
    }
  });
}

// Encodes UTF-8 text (flags: SpmFlags) into out[0, cap); *count is the number of ids, which may exceed cap (then
// nothing is written: call again with room for *count).
int rl_spm_encode(void* handle, const char* text, int64_t bytes, int64_t flags, int32_t* out, int64_t cap,
                  int64_t* count) {
  return guarded([&] {
    std::vector<int32_t> ids;
    spm_encode(*static_cast<const SpmTokenizer*>(handle), std::string_view(text, bytes), flags, ids);
    *count = static_cast<int64_t>(ids.size());
    if (*count <= cap) std::copy(ids.begin(), ids.end(), out);
  });
}

// Where each of `count` GGUF strings (a u64 byte length, then the bytes) starts, the first at byte `at` of a buffer of
// `size` bytes: starts[i] (the length's offset); returns where the last one ends, or -1 where one runs past the end.
int64_t rl_gguf_string_starts(const uint8_t* buf, int64_t size, int64_t at, int64_t count, int64_t* starts) {
  for (int64_t i = 0; i < count; ++i) {
    if (at < 0 || size - at < 8) return -1;
    uint64_t length;
    std::memcpy(&length, buf + at, 8);
    if (length > static_cast<uint64_t>(size - at - 8)) return -1;
    starts[i] = at;
    at += 8 + static_cast<int64_t>(length);
  }
  return at;
}

}  // extern "C"
#endif  // RUNLM_STANDALONE
