// runlm kernels: the native tokenizer's encoders (runlm.text.spm: SentencePiece BPE; runlm.text.bpe: byte-level BPE),
// and the walk over a GGUF vocabulary's string lengths (runlm.formats.gguf).
// A part of kernels.cpp's one translation unit, included in order (the C library build only).
//
// GGUF's 'llama' tokenizer model stores pieces and scores, no merges. runlm.text.tokenizer turns them into the merge
// list transformers' converter writes (every split of a piece into two pieces, best-ranked piece first, then the longer
// left part, then the longer right part, then the piece's place in the vocabulary) for the `tokenizers` library;
// building that list and the library's tables for Gemma's 262k pieces took most of a model's load. Here the rank of a
// pair is computed when the pair meets, from the same four keys, so nothing is built but one hash table of the
// pieces: the same ids as the `tokenizers` backend (the tests compare both), at a few milliseconds of load.
//
// GGUF's 'gpt2' model (byte-level BPE: Llama 3, Qwen, SmolLM, gpt-oss) lists its merges; handing 150k pieces and merges
// to the `tokenizers` library as Python objects took a tenth of a second of every load. Here the pieces are keyed by
// the bytes they stand for, the merges by the pair of ids they join, and the text is cut by the family's split
// patterns (pretok.h) before each piece is merged: the `tokenizers` backend's ids again (tests/text compares them).
//
// An encode: the text is cut at the added tokens (leftmost, longest first, as `tokenizers` matches them; a special
// token read as text stays in its piece). SentencePiece: each piece between them normalized (spaces become U+2581,
// with a dummy prefix where the model adds one) and cut into characters, a character outside the vocabulary into its
// <0xNN> byte pieces (else the unknown piece, runs of them fused). Byte-level: each piece cut by the split patterns,
// then into bytes (a byte the vocabulary lacks is dropped). Then the best-ranked adjacent pair is merged until none
// is left (ties: the leftmost).
#ifdef RUNLM_STANDALONE

namespace {

constexpr std::string_view kMeta = "\xE2\x96\x81";  // U+2581, SentencePiece's space

enum SpmPrefix : int64_t { kPrefixNone = 0, kPrefixEachPiece = 1, kPrefixFirstPiece = 2 };
enum SpmFlags : int64_t { kSpecialsAsText = 1, kAfterSpecial = 2 };

uint64_t spm_hash(std::string_view s) {  // FNV-1a
  uint64_t h = 1469598103934665603ull;
  for (const unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Pieces by their bytes: open addressing over one blob of every piece's bytes.
struct PieceTable {
  std::string blob;              // every piece's bytes, one after another
  std::vector<int64_t> start;    // piece i is blob[start[i], start[i + 1])
  std::vector<int32_t> slots;    // a piece's id (its last one where a piece repeats), or -1
  uint64_t mask = 0;
  int64_t distinct = 0;

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

  int64_t size() const { return static_cast<int64_t>(start.size()) - 1; }

  // Sizes the slots for n pieces (call after the blob holds them all); then `put` each id in order.
  void open_slots(int64_t n) {
    uint64_t slots_size = 1024;
    while (slots_size < 2 * static_cast<uint64_t>(n)) slots_size *= 2;
    slots.assign(slots_size, -1);
    mask = slots_size - 1;
  }

  // Files piece `id` (a later repeat takes the slot); returns the id that held its slot before, or -1.
  int32_t put(int32_t id) {
    const uint64_t slot = slot_of(piece(id));
    const int32_t before = slots[slot];
    distinct += before < 0;
    slots[slot] = id;
    return before;
  }
};

// Tokens matched whole in text: a byte trie, node 0 the root; terminal[node] = the token's id, or -1.
struct AddedTokens {
  std::unordered_map<uint64_t, int32_t> edges;
  std::vector<int32_t> terminal{-1};
  std::vector<uint8_t> special{0};
  bool starts[256] = {};

  void add(std::string_view text, int32_t id, bool is_special) {
    int32_t node = 0;
    for (const char c : text) {
      const auto [it, added] = edges.try_emplace(static_cast<uint64_t>(node) << 8 | static_cast<uint8_t>(c),
                                                 static_cast<int32_t>(terminal.size()));
      if (added) terminal.push_back(-1), special.push_back(0);
      node = it->second;
    }
    terminal[node] = id;
    special[node] = is_special;
    starts[static_cast<uint8_t>(text[0])] = true;
  }

  // Cuts text at the added tokens (leftmost, longest first; a special one left in the text where
  // kSpecialsAsText): on_text(piece, at_start) for each piece between them, on_token(id) for each token.
  template <class OnText, class OnToken>
  void cut(std::string_view text, int64_t flags, OnText on_text, OnToken on_token) const {
    size_t piece_start = 0, pos = 0;
    while (pos < text.size()) {
      if (starts[static_cast<unsigned char>(text[pos])]) {
        int32_t node = 0, found = -1;
        size_t found_end = 0;
        for (size_t j = pos; j < text.size(); ++j) {
          const auto it = edges.find(static_cast<uint64_t>(node) << 8 | static_cast<unsigned char>(text[j]));
          if (it == edges.end()) break;
          node = it->second;
          if (terminal[node] >= 0) found = node, found_end = j + 1;
        }
        if (found >= 0) {
          if (!((flags & kSpecialsAsText) && special[found])) {
            on_text(text.substr(piece_start, pos - piece_start), piece_start == 0);
            on_token(terminal[found]);
            piece_start = found_end;
          }
          pos = found_end;
          continue;
        }
      }
      ++pos;
    }
    on_text(text.substr(piece_start), piece_start == 0);
  }
};

struct SpmTokenizer {
  PieceTable pieces;
  std::vector<double> score;     // by id: the ranking of the merge that makes this piece
  std::vector<int32_t> first;    // by id: where the piece first appears (a tie's order)
  std::vector<int32_t> chars;    // by id: the piece's length in characters
  int32_t byte_id[256];
  int32_t unk = -1;
  int64_t prefix = kPrefixNone;
  AddedTokens added;

  std::string_view piece(int32_t id) const { return pieces.piece(id); }
  int32_t lookup(std::string_view s) const { return pieces.lookup(s); }
};

// Splits a blob of n NUL-ended strings into the table's blob (without the NULs) and starts.
void read_pieces(const char* blob, int64_t blob_bytes, int64_t n, PieceTable& table) {
  RUNLM_CHECK(n > 0 && n < (int64_t{1} << 31), "a vocabulary of ", n, " pieces");
  table.blob.reserve(blob_bytes);
  table.start.reserve(n + 1);
  for (int64_t at = 0, i = 0; i < n; ++i) {
    const char* end = static_cast<const char*>(memchr(blob + at, 0, blob_bytes - at));
    RUNLM_CHECK(end != nullptr, "the vocabulary's bytes hold ", i, " pieces, not ", n);
    table.start.push_back(static_cast<int64_t>(table.blob.size()));
    table.blob.append(blob + at, end - (blob + at));
    at = end - blob + 1;
  }
  RUNLM_CHECK(table.blob.size() + n == static_cast<size_t>(blob_bytes), "the vocabulary's bytes hold more than ", n,
              " pieces (a piece with a NUL in it?)");
  table.start.push_back(static_cast<int64_t>(table.blob.size()));
}

int32_t utf8_chars(std::string_view s) {
  int32_t n = 0;
  for (const unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
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

// Merges adjacent symbols, the best-ranked pair first (Merge's order: the top of a priority queue; a pair whose
// pieces changed since it was queued is skipped), then appends the ids left to `out`. pair_of(left id, right id, pos,
// &merge) says whether the two pieces at pos merge, and how the merge ranks (its .id: the piece they make).
template <class Merge, class PairOf>
void merge_symbols(std::vector<SpmSymbol>& symbols, PairOf pair_of, std::vector<int32_t>& out) {
  if (symbols.empty()) return;
  symbols.back().next = -1;
  std::priority_queue<Merge> queue;
  Merge m;
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i)
    if (pair_of(symbols[i].id, symbols[i + 1].id, i, &m)) queue.push(m);
  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    SpmSymbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    const SpmSymbol right = symbols[left.next];
    if (!pair_of(left.id, right.id, top.pos, &m) || m.id != top.id) continue;  // a stale pair
    symbols[left.next].alive = false;
    left.id = top.id;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0 && pair_of(symbols[left.prev].id, left.id, left.prev, &m)) queue.push(m);
    if (left.next >= 0 && pair_of(left.id, symbols[left.next].id, top.pos, &m)) queue.push(m);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
}

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
  std::string scratch;
  merge_symbols<SpmMerge>(symbols, [&](int32_t left, int32_t right, int32_t pos, SpmMerge* m) {
    return spm_pair(t, left, right, pos, scratch, m);
  }, out);
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
  t.added.cut(text, flags, [&](std::string_view piece, bool at_start) {
    spm_text(t, piece, at_start, flags, normalized, out);
  }, [&](int32_t id) { out.push_back(id); });
}

// ---- byte-level BPE

// GPT-2's spelling of bytes as characters: the printable ones as themselves, the other 68 as U+0100 on, in order.
struct ByteAlphabet {
  char32_t of_byte[256];
  int16_t byte_of[0x144];  // -1: not a byte's character
  ByteAlphabet() {
    std::fill(std::begin(byte_of), std::end(byte_of), int16_t{-1});
    char32_t extra = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      of_byte[b] = printable ? static_cast<char32_t>(b) : extra++;
      byte_of[of_byte[b]] = static_cast<int16_t>(b);
    }
  }
  int byte(char32_t c) const { return c < 0x144 ? byte_of[c] : -1; }
};
const ByteAlphabet kByteAlphabet;

// The bytes a byte-level spelling stands for (into *out); false where a character is outside the byte alphabet.
bool spelled_bytes(std::string_view spelling, std::string* out, std::vector<char32_t>& points,
                   std::vector<int64_t>& at) {
  utf8_points(spelling, points, at);
  out->clear();
  for (const char32_t c : points) {
    const int b = kByteAlphabet.byte(c);
    if (b < 0) return false;
    out->push_back(static_cast<char>(b));
  }
  return true;
}

enum GgufTokenType : int32_t { kTokenControl = 3, kTokenUserDefined = 4 };

struct BpeTokenizer {
  PieceTable pieces;  // keyed by the bytes each piece stands for
  // pieces spelled outside the byte alphabet that are control or user-defined tokens: no text's bytes spell them,
  // and the vocabulary keys them by their text (the last id of each)
  std::unordered_map<std::string, int32_t> unreachable;
  std::vector<uint8_t> is_unreachable;
  int32_t byte_id[256];
  // merges: (left id << 32 | right id) -> (rank, merged id); open addressing, key ~0: empty
  std::vector<uint64_t> merge_keys;
  std::vector<std::pair<int32_t, int32_t>> merge_values;
  uint64_t merge_mask = 0;
  bool ignore_merges = false;
  std::vector<Regex> splits;  // the split patterns, each applied to every piece the ones before it cut
  AddedTokens added;

  static uint64_t pair_key(int32_t left, int32_t right) {
    return static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32 | static_cast<uint32_t>(right);
  }
  uint64_t merge_slot(uint64_t key) const {
    uint64_t i = (key * 0x9E3779B97F4A7C15ull >> 17) & merge_mask;
    while (merge_keys[i] != ~0ull && merge_keys[i] != key) i = (i + 1) & merge_mask;
    return i;
  }
  // The merge of two adjacent pieces (rank, id), or nullptr.
  const std::pair<int32_t, int32_t>* merge(int32_t left, int32_t right) const {
    const uint64_t slot = merge_slot(pair_key(left, right));
    return merge_keys[slot] == ~0ull ? nullptr : &merge_values[slot];
  }
};

struct BpeMerge {
  int32_t rank, pos, id;
  bool operator<(const BpeMerge& o) const {  // the queue's top: the lowest rank, then the leftmost
    return rank != o.rank ? rank > o.rank : pos > o.pos;
  }
};

// One pre-tokenized piece (its bytes) -> ids, appended to `out`.
void bpe_word(const BpeTokenizer& t, std::string_view bytes, std::vector<int32_t>& out) {
  if (t.ignore_merges) {
    const int32_t whole = t.pieces.lookup(bytes);
    if (whole >= 0) {
      out.push_back(whole);
      return;
    }
  }
  std::vector<SpmSymbol> symbols;
  symbols.reserve(bytes.size());
  for (const char c : bytes) {
    const int32_t id = t.byte_id[static_cast<unsigned char>(c)];
    if (id < 0) continue;
    const int32_t at = static_cast<int32_t>(symbols.size());
    symbols.push_back(SpmSymbol{id, at - 1, at + 1, true});
  }
  merge_symbols<BpeMerge>(symbols, [&](int32_t left, int32_t right, int32_t pos, BpeMerge* m) {
    const auto* found = t.merge(left, right);
    if (found != nullptr) *m = BpeMerge{found->first, pos, found->second};
    return found != nullptr;
  }, out);
}

// Text between added tokens: cut by each split pattern in turn, then each piece merged.
void bpe_text(const BpeTokenizer& t, std::string_view text, std::vector<int32_t>& out) {
  if (text.empty()) return;
  std::vector<char32_t> points;
  std::vector<int64_t> at;
  utf8_points(text, points, at);
  std::vector<int64_t> ends{static_cast<int64_t>(points.size())}, next;
  for (const Regex& re : t.splits) {
    next.clear();
    int64_t begin = 0;
    for (const int64_t end : ends) {
      split_isolated(re, points.data(), begin, end, next);
      begin = end;
    }
    ends.swap(next);
  }
  int64_t begin = 0;
  for (const int64_t end : ends) {
    bpe_word(t, text.substr(at[begin], at[end] - at[begin]), out);
    begin = end;
  }
}

}  // namespace

extern "C" {

// A tokenizer of `n` pieces (blob: their UTF-8 bytes, each ended by a NUL; scores: the ranking of the merge making
// each), its byte pieces and unknown piece found by name; prefix: SpmPrefix. Returns null (rl_last_error says why).
void* rl_spm_new(const char* blob, int64_t blob_bytes, int64_t n, const double* scores, int64_t prefix) {
  SpmTokenizer* made = nullptr;
  const int rc = guarded([&] {
    RUNLM_CHECK(prefix >= kPrefixNone && prefix <= kPrefixFirstPiece, "unknown prefix rule ", prefix);
    auto t = std::make_unique<SpmTokenizer>();
    read_pieces(blob, blob_bytes, n, t->pieces);
    t->score.assign(scores, scores + n);  // a repeated piece: the last one's score (and its first one's place)
    t->first.resize(n);
    t->chars.resize(n);
    t->pieces.open_slots(n);
    for (int32_t i = 0; i < n; ++i) {
      const int32_t before = t->pieces.put(i);
      t->first[i] = before >= 0 ? t->first[before] : i;
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
    t.added.add(std::string_view(text, bytes), static_cast<int32_t>(id), special != 0);
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
  return static_cast<const SpmTokenizer*>(handle)->pieces.distinct;
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

// A byte-level BPE tokenizer: n pieces (tokens: their byte-level spellings, each ended by a NUL; types: their GGUF
// token types), n_merges merges ("left right", each ended by a NUL; rank: the order), n_patterns split patterns (each
// ended by a NUL, applied in turn) and whether a piece the vocabulary holds whole skips the merges. Returns null
// (rl_last_error says why: a pattern outside pretok.h's language, a merge of pieces the vocabulary lacks).
void* rl_bpe_new(const char* tokens, int64_t tokens_bytes, int64_t n, const int32_t* types, const char* merges,
                 int64_t merges_bytes, int64_t n_merges, const char* patterns, int64_t patterns_bytes, int64_t n_patterns,
                 int64_t ignore_merges) {
  BpeTokenizer* made = nullptr;
  const int rc = guarded([&] {
    auto t = std::make_unique<BpeTokenizer>();
    PieceTable spellings;
    read_pieces(tokens, tokens_bytes, n, spellings);
    std::vector<char32_t> points;
    std::vector<int64_t> at;
    std::string bytes;
    t->is_unreachable.assign(n, 0);
    t->pieces.blob.reserve(spellings.blob.size());
    t->pieces.start.reserve(n + 1);
    for (int32_t i = 0; i < n; ++i) {
      const std::string_view spelling = spellings.piece(i);
      t->pieces.start.push_back(static_cast<int64_t>(t->pieces.blob.size()));
      if (spelled_bytes(spelling, &bytes, points, at)) {
        t->pieces.blob.append(bytes);
      } else if (types[i] == kTokenControl || types[i] == kTokenUserDefined) {
        t->is_unreachable[i] = 1;
        t->unreachable[std::string(spelling)] = i;
      } else {
        t->pieces.blob.append(spelling);  // raw text: the bytes it is written in
      }
    }
    t->pieces.start.push_back(static_cast<int64_t>(t->pieces.blob.size()));
    t->pieces.open_slots(n);
    for (int32_t i = 0; i < n; ++i)
      if (!t->is_unreachable[i]) t->pieces.put(i);
    for (int b = 0; b < 256; ++b) t->byte_id[b] = t->pieces.lookup(std::string(1, static_cast<char>(b)));

    RUNLM_CHECK(n_merges >= 0 && n_merges < (int64_t{1} << 31), n_merges, " merges");
    uint64_t slots = 1024;
    while (slots < 2 * static_cast<uint64_t>(n_merges)) slots *= 2;
    t->merge_keys.assign(slots, ~0ull);
    t->merge_values.resize(slots);
    t->merge_mask = slots - 1;
    std::string left, right, joined;
    const auto piece_id = [&](std::string_view spelling, std::string* key) -> int32_t {
      if (spelled_bytes(spelling, key, points, at)) return t->pieces.lookup(*key);
      const auto found = t->unreachable.find(std::string(spelling));
      return found == t->unreachable.end() ? -1 : -2 - found->second;  // -2 - id: an unreachable piece
    };
    for (int64_t at_byte = 0, rank = 0; rank < n_merges; ++rank) {
      const char* end = static_cast<const char*>(memchr(merges + at_byte, 0, merges_bytes - at_byte));
      RUNLM_CHECK(end != nullptr, "the merges' bytes hold ", rank, " merges, not ", n_merges);
      const std::string_view merge(merges + at_byte, end - (merges + at_byte));
      at_byte = end - merges + 1;
      const size_t first = merge.empty() ? 0 : utf8_length(static_cast<unsigned char>(merge[0]));
      const size_t cut = merge.find(' ', first);
      RUNLM_CHECK(cut != std::string_view::npos, "merge ", rank, " is not 'left right'");
      const int32_t a = piece_id(merge.substr(0, cut), &left), b = piece_id(merge.substr(cut + 1), &right);
      RUNLM_CHECK(a != -1 && b != -1, "merge ", rank, " joins a piece the vocabulary lacks");
      if (a < -1 || b < -1) continue;  // a piece no text spells: this merge never meets
      joined = left + right;
      const int32_t id = t->pieces.lookup(joined);
      RUNLM_CHECK(id >= 0, "merge ", rank, " makes a piece the vocabulary lacks");
      const uint64_t key = BpeTokenizer::pair_key(a, b), slot = t->merge_slot(key);
      t->merge_keys[slot] = key;  // a repeated pair: the later merge's rank, as in `tokenizers`
      t->merge_values[slot] = {static_cast<int32_t>(rank), id};
    }
    for (int64_t at_byte = 0, k = 0; k < n_patterns; ++k) {
      const char* end = static_cast<const char*>(memchr(patterns + at_byte, 0, patterns_bytes - at_byte));
      RUNLM_CHECK(end != nullptr, "the patterns' bytes hold ", k, " patterns, not ", n_patterns);
      t->splits.emplace_back(std::string_view(patterns + at_byte, end - (patterns + at_byte)));
      at_byte = end - patterns + 1;
    }
    t->ignore_merges = ignore_merges != 0;
    made = t.release();
  });
  return rc == 0 ? made : nullptr;
}

// Adds a token matched whole in text (special: one that encoding with kSpecialsAsText reads as text instead).
int rl_bpe_add_token(void* handle, const char* text, int64_t bytes, int64_t id, int64_t special) {
  return guarded([&] {
    BpeTokenizer& t = *static_cast<BpeTokenizer*>(handle);
    RUNLM_CHECK(bytes > 0 && id >= 0 && id < t.pieces.size(), "an added token must have text and an id in the "
                "vocabulary");
    t.added.add(std::string_view(text, bytes), static_cast<int32_t>(id), special != 0);
  });
}

void rl_bpe_free(void* handle) { delete static_cast<BpeTokenizer*>(handle); }

// How many distinct spellings the vocabulary has.
int64_t rl_bpe_size(void* handle) {
  const BpeTokenizer& t = *static_cast<const BpeTokenizer*>(handle);
  return t.pieces.distinct + static_cast<int64_t>(t.unreachable.size());
}

// The id of the piece spelled `text` (a byte-level spelling, or a control token's text), or -1.
int64_t rl_bpe_piece_id(void* handle, const char* text, int64_t bytes) {
  const BpeTokenizer& t = *static_cast<const BpeTokenizer*>(handle);
  std::vector<char32_t> points;
  std::vector<int64_t> at;
  std::string key;
  const std::string_view spelling(text, bytes);
  if (spelled_bytes(spelling, &key, points, at)) return t.pieces.lookup(key);
  const auto found = t.unreachable.find(std::string(spelling));
  return found == t.unreachable.end() ? -1 : found->second;
}

// For each of n ids: 1 where the vocabulary finds that piece's spelling at that id (not at a later repeat), else 0.
int rl_bpe_own_ids(void* handle, const int64_t* ids, int64_t n, uint8_t* out) {
  return guarded([&] {
    const BpeTokenizer& t = *static_cast<const BpeTokenizer*>(handle);
    for (int64_t i = 0; i < n; ++i) {
      RUNLM_CHECK(ids[i] >= 0 && ids[i] < t.pieces.size(), "piece id ", ids[i], " out of range");
      const int32_t id = static_cast<int32_t>(ids[i]);
      out[i] = t.is_unreachable[id] ? 0 : t.pieces.lookup(t.pieces.piece(id)) == id;
    }
  });
}

// Encodes UTF-8 text (flags: kSpecialsAsText) into out[0, cap); *count is the number of ids, which may exceed cap
// (then nothing is written: call again with room for *count).
int rl_bpe_encode(void* handle, const char* text, int64_t bytes, int64_t flags, int32_t* out, int64_t cap,
                  int64_t* count) {
  return guarded([&] {
    const BpeTokenizer& t = *static_cast<const BpeTokenizer*>(handle);
    std::vector<int32_t> ids;
    t.added.cut(std::string_view(text, bytes), flags, [&](std::string_view piece, bool) { bpe_text(t, piece, ids); },
                [&](int32_t id) { ids.push_back(id); });
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
