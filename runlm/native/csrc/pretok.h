// runlm kernels: the byte-level BPE pre-tokenizers' regexes (runlm.text.tokenizer's _LLAMA3_SPLIT, ...), matched as
// the `tokenizers` library's Oniguruma matches them, for the native encoder (tokenizer.h).
// A part of kernels.cpp's one translation unit, included in order (the C library build only).
//
// The regexes are a small language: literals, classes ([...], \s, \p{L}, \p{Lu}, ...), alternation, groups
// ((?:...), (?i:...)), greedy quantifiers of one character (?, *, +, {m,n}) or of a group (? only), and negative
// lookahead ((?!...)). A pattern outside it is refused when the encoder is made, and the caller takes the
// `tokenizers` route. Matching backtracks as Oniguruma does (leftmost alternative first, longest repeat first), with
// the rest of the pattern passed down as a continuation: recursion goes as deep as the pattern, not the text.
#ifdef RUNLM_STANDALONE
#include <cstdio>
#include <memory>
#include <queue>
#include <string_view>
#include <unordered_map>

namespace {

// Bytes in the UTF-8 sequence a lead byte starts (a stray continuation byte: 1).
size_t utf8_length(unsigned char lead) {
  return lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
}

// The code point of one UTF-8 sequence (utf8_length's bytes).
char32_t utf8_point(std::string_view s) {
  const auto b = [&](size_t i) { return static_cast<char32_t>(static_cast<unsigned char>(s[i])); };
  switch (s.size()) {
    case 1: return b(0);
    case 2: return (b(0) & 0x1F) << 6 | (b(1) & 0x3F);
    case 3: return (b(0) & 0x0F) << 12 | (b(1) & 0x3F) << 6 | (b(2) & 0x3F);
    default: return (b(0) & 0x07) << 18 | (b(1) & 0x3F) << 12 | (b(2) & 0x3F) << 6 | (b(3) & 0x3F);
  }
}

// The class of code point c (UnicodeClass), by binary search of the runs.
uint8_t unicode_class(char32_t c) {
  const uint32_t key = static_cast<uint32_t>(c) << 4 | 0xF;
  const uint32_t* run = std::upper_bound(std::begin(kUnicodeRuns), std::end(kUnicodeRuns), key) - 1;
  return static_cast<uint8_t>(*run & 0xF);
}

// UTF-8 text as code points, and where each starts (bytes; one more entry: the end). Text from Python is valid UTF-8.
void utf8_points(std::string_view text, std::vector<char32_t>& points, std::vector<int64_t>& at) {
  points.clear(), at.clear();
  for (size_t i = 0; i < text.size();) {
    const size_t n = std::min(utf8_length(static_cast<unsigned char>(text[i])), text.size() - i);
    points.push_back(utf8_point(text.substr(i, n)));
    at.push_back(static_cast<int64_t>(i));
    i += n;
  }
  at.push_back(static_cast<int64_t>(text.size()));
}

// Oniguruma's \s: the Unicode White_Space characters.
bool unicode_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// The simple case folding of the characters a case-insensitive literal may meet: ASCII letters, and the two
// non-ASCII characters that fold onto ASCII ones (long s, the Kelvin sign).
char32_t fold_case(char32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c == 0x17F) return 's';
  if (c == 0x212A) return 'k';
  return c;
}

struct CharClass {
  bool negated = false, space = false, not_space = false;
  uint16_t classes = 0;  // bit k: UnicodeClass k
  std::vector<std::pair<char32_t, char32_t>> ranges;

  bool matches(char32_t c) const {
    bool in = (space && unicode_space(c)) || (not_space && !unicode_space(c)) ||
              (classes && (classes >> unicode_class(c) & 1));
    for (size_t i = 0; !in && i < ranges.size(); ++i) in = c >= ranges[i].first && c <= ranges[i].second;
    return in != negated;
  }
};

struct ReNode {
  enum Kind : uint8_t { kLiteral, kClass, kSeq, kAlt, kRepeat, kNotAhead } kind;
  char32_t literal = 0;
  bool fold = false;       // a case-insensitive literal
  int32_t cls = -1;        // kClass: its CharClass
  int32_t min = 0, max = 0;  // kRepeat
  std::vector<int32_t> kids;
};

class Regex {
 public:
  explicit Regex(std::string_view pattern) {
    std::vector<int64_t> starts;
    utf8_points(pattern, pat_, starts);
    root_ = alternation(false);
    RUNLM_CHECK(pos_ == pat_.size(), "unbalanced ')' in the split pattern");
  }

  // The end of the match starting at text[pos] (code points), or -1 where none starts there.
  int64_t match_at(const char32_t* text, int64_t size, int64_t pos) const {
    const Subject s{text, size};
    return run(s, root_, pos, nullptr);
  }

 private:
  struct Subject {
    const char32_t* text;
    int64_t size;
  };
  // The rest of the pattern after a sequence's kid: the sequence's later kids, then `up`.
  struct Cont {
    int32_t seq;
    size_t next;
    const Cont* up;
  };

  std::vector<char32_t> pat_;
  size_t pos_ = 0;
  std::vector<ReNode> nodes_;
  std::vector<CharClass> classes_;
  int32_t root_ = -1;

  int32_t add(ReNode node) {
    nodes_.push_back(std::move(node));
    return static_cast<int32_t>(nodes_.size() - 1);
  }
  bool at_end() const { return pos_ >= pat_.size(); }
  char32_t peek() const { return pat_[pos_]; }
  bool eat(char32_t c) {
    if (at_end() || peek() != c) return false;
    ++pos_;
    return true;
  }

  int32_t alternation(bool fold) {
    ReNode alt{ReNode::kAlt};
    alt.kids.push_back(sequence(fold));
    while (eat('|')) alt.kids.push_back(sequence(fold));
    return alt.kids.size() == 1 ? alt.kids[0] : add(std::move(alt));
  }

  int32_t sequence(bool fold) {
    ReNode seq{ReNode::kSeq};
    while (!at_end() && peek() != '|' && peek() != ')') seq.kids.push_back(quantified(fold));
    return add(std::move(seq));
  }

  int32_t quantified(bool fold) {
    const int32_t atom_id = atom(fold);
    int32_t lo, hi;
    if (eat('?')) lo = 0, hi = 1;
    else if (eat('*')) lo = 0, hi = INT32_MAX;
    else if (eat('+')) lo = 1, hi = INT32_MAX;
    else if (eat('{')) {
      lo = number();
      hi = eat(',') ? (!at_end() && peek() == '}' ? INT32_MAX : number()) : lo;
      RUNLM_CHECK(eat('}') && lo <= hi, "a bad {m,n} in the split pattern");
    } else {
      return atom_id;
    }
    RUNLM_CHECK(!eat('?') && !eat('+'), "lazy or possessive quantifiers are not supported in split patterns");
    const bool one_char = nodes_[atom_id].kind == ReNode::kLiteral || nodes_[atom_id].kind == ReNode::kClass;
    RUNLM_CHECK(one_char || hi == 1, "only one character or an optional group may repeat in a split pattern");
    ReNode rep{ReNode::kRepeat};
    rep.min = lo, rep.max = hi;
    rep.kids.push_back(atom_id);
    return add(std::move(rep));
  }

  int32_t number() {
    int64_t v = 0;
    RUNLM_CHECK(!at_end() && peek() >= '0' && peek() <= '9', "a number expected in the split pattern's {m,n}");
    while (!at_end() && peek() >= '0' && peek() <= '9') v = std::min<int64_t>(v * 10 + (pat_[pos_++] - '0'), 1 << 30);
    return static_cast<int32_t>(v);
  }

  int32_t atom(bool fold) {
    RUNLM_CHECK(!at_end(), "the split pattern ends early");
    const char32_t c = pat_[pos_++];
    if (c == '(') {
      int32_t node;
      if (eat('?')) {
        if (eat(':')) {
          node = alternation(fold);
        } else if (eat('i')) {
          RUNLM_CHECK(eat(':'), "only (?i:...) flags are supported in split patterns");
          node = alternation(true);
        } else if (eat('!')) {
          ReNode ahead{ReNode::kNotAhead};
          ahead.kids.push_back(alternation(fold));
          node = add(std::move(ahead));
        } else {
          RUNLM_CHECK(false, "unsupported group in the split pattern");
        }
      } else {
        node = alternation(fold);  // a capture group splits as a plain one
      }
      RUNLM_CHECK(eat(')'), "unbalanced '(' in the split pattern");
      return node;
    }
    if (c == '[') return class_node(bracket());
    if (c == '\\') {
      CharClass cls;
      char32_t lit;
      if (escape(&cls, &lit)) return class_node(std::move(cls));
      return literal(lit, fold);
    }
    RUNLM_CHECK(c != '.' && c != '^' && c != '$' && c != ')' && c != '*' && c != '+' && c != '?' && c != '{',
                "unsupported character in the split pattern");
    return literal(c, fold);
  }

  int32_t literal(char32_t c, bool fold) {
    ReNode lit{ReNode::kLiteral};
    lit.literal = fold ? fold_case(c) : c;
    lit.fold = fold;
    return add(std::move(lit));
  }

  int32_t class_node(CharClass cls) {
    classes_.push_back(std::move(cls));
    ReNode node{ReNode::kClass};
    node.cls = static_cast<int32_t>(classes_.size() - 1);
    return add(std::move(node));
  }

  // After a backslash: a class escape (into *cls, true) or an escaped character (into *lit, false).
  bool escape(CharClass* cls, char32_t* lit) {
    RUNLM_CHECK(!at_end(), "the split pattern ends in a backslash");
    const char32_t c = pat_[pos_++];
    switch (c) {
      case 's': cls->space = true; return true;
      case 'S': cls->not_space = true; return true;
      case 'p': case 'P': {
        RUNLM_CHECK(eat('{'), "\\p needs {name} in the split pattern");
        std::string name;
        while (!at_end() && peek() != '}') name.push_back(static_cast<char>(pat_[pos_++]));
        RUNLM_CHECK(eat('}'), "unterminated \\p{...} in the split pattern");
        static const std::pair<const char*, uint16_t> kNames[] = {
            {"L", 0x1F}, {"Lu", 1 << kULu}, {"Ll", 1 << kULl}, {"Lt", 1 << kULt}, {"Lm", 1 << kULm},
            {"Lo", 1 << kULo}, {"M", 1 << kUM}, {"N", 1 << kUN}, {"P", 1 << kUP}, {"S", 1 << kUS}};
        uint16_t bits = 0;
        for (const auto& [known, mask] : kNames) bits = name == known ? mask : bits;
        RUNLM_CHECK(bits != 0, "unsupported class \\p{", name, "} in the split pattern");
        cls->classes = bits;
        cls->negated = c == 'P';
        return true;
      }
      case 'r': *lit = '\r'; return false;
      case 'n': *lit = '\n'; return false;
      case 't': *lit = '\t'; return false;
      case 'f': *lit = '\f'; return false;
      case 'v': *lit = '\v'; return false;
      default:
        RUNLM_CHECK(!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')),
                    "unsupported escape in the split pattern");
        *lit = c;  // an escaped punctuation character
        return false;
    }
  }

  // [...] after its '[': one class of characters, ranges and escapes.
  CharClass bracket() {
    CharClass cls;
    cls.negated = eat('^');
    bool first = true;
    while (true) {
      RUNLM_CHECK(!at_end(), "unterminated [...] in the split pattern");
      if (peek() == ']' && !first) {
        ++pos_;
        return cls;
      }
      first = false;
      char32_t lo = pat_[pos_++];
      if (lo == '\\') {
        CharClass inner;
        if (escape(&inner, &lo)) {  // \s, \S, \p{..} inside the brackets
          RUNLM_CHECK(!inner.negated, "\\P{...} inside [...] is not supported in split patterns");
          cls.space |= inner.space, cls.not_space |= inner.not_space, cls.classes |= inner.classes;
          continue;
        }
      } else {
        RUNLM_CHECK(lo != '[', "nested [...] is not supported in split patterns");
      }
      char32_t hi = lo;
      if (pos_ + 1 < pat_.size() && peek() == '-' && pat_[pos_ + 1] != ']') {
        ++pos_;
        hi = pat_[pos_++];
        if (hi == '\\') {
          CharClass inner;
          RUNLM_CHECK(!escape(&inner, &hi), "a class cannot end a range in the split pattern");
        }
        RUNLM_CHECK(lo <= hi, "a reversed range in the split pattern");
      }
      cls.ranges.emplace_back(lo, hi);
    }
  }

  bool one(const Subject& s, const ReNode& n, int64_t pos) const {
    if (pos >= s.size) return false;
    const char32_t c = s.text[pos];
    if (n.kind == ReNode::kLiteral) return n.fold ? fold_case(c) == n.literal : c == n.literal;
    return classes_[n.cls].matches(c);
  }

  int64_t resume(const Subject& s, const Cont* k, int64_t pos) const {
    if (k == nullptr) return pos;
    const ReNode& seq = nodes_[k->seq];
    if (k->next == seq.kids.size()) return resume(s, k->up, pos);
    const Cont rest{k->seq, k->next + 1, k->up};
    return run(s, seq.kids[k->next], pos, &rest);
  }

  int64_t run(const Subject& s, int32_t id, int64_t pos, const Cont* k) const {
    const ReNode& n = nodes_[id];
    switch (n.kind) {
      case ReNode::kLiteral:
      case ReNode::kClass:
        return one(s, n, pos) ? resume(s, k, pos + 1) : -1;
      case ReNode::kSeq: {
        const Cont start{id, 0, k};
        return resume(s, &start, pos);
      }
      case ReNode::kAlt:
        for (const int32_t kid : n.kids) {
          const int64_t end = run(s, kid, pos, k);
          if (end >= 0) return end;
        }
        return -1;
      case ReNode::kRepeat: {
        const ReNode& body = nodes_[n.kids[0]];
        if (body.kind == ReNode::kLiteral || body.kind == ReNode::kClass) {
          int64_t count = 0;
          while (count < n.max && one(s, body, pos + count)) ++count;
          for (; count >= n.min; --count) {
            const int64_t end = resume(s, k, pos + count);
            if (end >= 0) return end;
          }
          return -1;
        }
        const int64_t end = run(s, n.kids[0], pos, k);  // an optional group: with it first, then without
        if (end >= 0) return end;
        return n.min == 0 ? resume(s, k, pos) : -1;
      }
      case ReNode::kNotAhead:
        return run(s, n.kids[0], pos, nullptr) >= 0 ? -1 : resume(s, k, pos);
    }
    return -1;
  }
};

// Cuts [begin, end) of text (code points) as a `tokenizers` Split(pattern, "isolated") does: each match, and each
// run between matches, is a piece; `out` gets the pieces' ends.
void split_isolated(const Regex& re, const char32_t* text, int64_t begin, int64_t end, std::vector<int64_t>& out) {
  int64_t pos = begin;
  while (pos < end) {
    int64_t found = pos, match_end = -1;
    for (; found < end; ++found) {
      match_end = re.match_at(text, end, found);
      if (match_end > found) break;
    }
    if (found >= end) {
      out.push_back(end);
      return;
    }
    if (found > pos) out.push_back(found);
    out.push_back(match_end);
    pos = match_end;
  }
}

}  // namespace

#endif  // RUNLM_STANDALONE
