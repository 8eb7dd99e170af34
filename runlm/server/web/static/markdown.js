/* runlm chat page: a small Markdown renderer and syntax highlighter.
 *
 * Safety by construction: the renderer builds DOM nodes and puts every piece of model text in through
 * text nodes / textContent. It never assigns innerHTML, so HTML in model output (a <script>, an <img
 * onerror=...>) is shown as the characters it is. Links are kept only for http(s): and mailto: URLs.
 *
 * Covers what chat models write: paragraphs, headings, emphasis, inline code, fenced code blocks (also
 * unclosed ones, while an answer streams), lists (nested), block quotes, tables, rules, links.
 *
 * Linear time by construction, because the text is untrusted and re-rendered on every streamed chunk: no
 * pattern can backtrack over a long run (none has two adjacent parts that match the same characters, or a
 * repeated part followed by an anchor it may miss), every closer (emphasis, code span, link label) is looked
 * up in a table built once per text instead of scanned for from each opener, nesting is capped (MAX_NESTING),
 * and a table's short rows get empty cells only up to the table's own size.
 */
(function () {
  'use strict';

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // Deeper block quotes / lists / emphasis than this render as plain text: each level re-reads its text.
  const MAX_NESTING = 16;

  // -- block level ------------------------------------------------------------------------------------

  const FENCE_OPEN = /^( {0,3})(`{3,}|~{3,})[ \t]*([^\s`]*)/;
  const HEADING_OPEN = /^ {0,3}(#{1,6})(?=[ \t]|$)/;
  const HR = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const UL = /^( {0,3})([-*+])(?:[ \t]+(.*))?$/;
  const OL = /^( {0,3})(\d{1,9})([.)])(?:[ \t]+(.*))?$/;
  const TABLE_CELL_SEP = /^[ \t]*:?-+:?[ \t]*$/;

  function isBlank(c) {
    return c === ' ' || c === '\t';
  }

  function trimEndBlank(s) {
    let end = s.length;
    while (end > 0 && isBlank(s[end - 1])) end--;
    return s.slice(0, end);
  }

  function fence(line) {
    // An opening fence: [whole, indent, fence, info word]; a backtick fence's line holds no other backtick.
    const m = FENCE_OPEN.exec(line);
    return m && line.indexOf('`', m[0].length) === -1 ? m : null;
  }

  function heading(line) {
    // [level, text] of an ATX heading, without its closing run of '#' (one preceded by a space or tab).
    const m = HEADING_OPEN.exec(line);
    if (!m) return null;
    let text = trimEndBlank(line.slice(m[0].length));
    let end = text.length;
    while (end > 0 && text[end - 1] === '#') end--;
    if (end < text.length && (end === 0 || isBlank(text[end - 1]))) text = trimEndBlank(text.slice(0, end));
    let start = 0;
    while (start < text.length && isBlank(text[start])) start++;
    return [m[1].length, text.slice(start)];
  }

  function isTableSeparator(line) {
    // | :-- | --: | :-: | (the outer pipes optional)
    let k = 0;
    while (k < 3 && line[k] === ' ') k++;
    let s = line.slice(k);
    if (s.startsWith('|')) s = s.slice(1);
    s = trimEndBlank(s);
    if (s.endsWith('|')) s = s.slice(0, -1);
    return s.split('|').every(function (cell) { return TABLE_CELL_SEP.test(cell); });
  }

  function listItem(line) {
    let m = UL.exec(line);
    if (m && !HR.test(line)) return { ordered: false, indent: m[1].length + m[2].length + 1, text: m[3] || '', m };
    m = OL.exec(line);
    if (m) return { ordered: true, start: parseInt(m[2], 10), indent: m[1].length + m[2].length + 2, text: m[4] || '', m };
    return null;
  }

  function startsBlock(line) {
    return fence(line) !== null || HEADING_OPEN.test(line) || HR.test(line) || QUOTE.test(line) || listItem(line) !== null;
  }

  function indentOf(line) {
    let cols = 0;
    for (let k = 0; k < line.length; k++) {
      if (line[k] === ' ') cols++;
      else if (line[k] === '\t') cols += 4 - (cols % 4);
      else break;
    }
    return cols;
  }

  function dedent(line, n) {
    // Drop up to n columns of leading white space (a tab counts to the next multiple of 4).
    let cols = 0;
    let k = 0;
    while (k < line.length && cols < n && (line[k] === ' ' || line[k] === '\t')) {
      cols += line[k] === ' ' ? 1 : 4 - (cols % 4);
      k++;
    }
    return line.slice(k);
  }

  function renderBlocks(lines, parent, depth) {
    if (depth > MAX_NESTING) {
      parent.appendChild(el('p', null, lines.join('\n')));
      return;
    }
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) { i++; continue; }
      let m;
      if ((m = fence(line))) {
        const indent = m[1].length;
        const marks = m[2];
        const close = new RegExp('^ {0,3}' + (marks[0] === '`' ? '`' : '~') + '{' + marks.length + ',}[ \\t]*$');
        const body = [];
        i++;
        while (i < lines.length && !close.test(lines[i])) {
          body.push(indent ? dedent(lines[i], indent) : lines[i]);
          i++;
        }
        if (i >= lines.length) { // no closing fence (yet: the answer may still be streaming)
          while (body.length && !body[body.length - 1].trim()) body.pop();
        }
        i++;
        parent.appendChild(codeBlock(body.join('\n'), m[3]));
        continue;
      }
      if ((m = heading(line))) {
        const h = el('h' + m[0]);
        inline(m[1], h);
        parent.appendChild(h);
        i++;
        continue;
      }
      if (HR.test(line)) {
        parent.appendChild(el('hr'));
        i++;
        continue;
      }
      if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && lines[i].trim()) {
          m = QUOTE.exec(lines[i]);
          if (m) inner.push(m[1]);
          else if (!startsBlock(lines[i])) inner.push(lines[i]); // lazy continuation
          else break;
          i++;
        }
        const quote = el('blockquote');
        renderBlocks(inner, quote, depth + 1);
        parent.appendChild(quote);
        continue;
      }
      if (listItem(line)) {
        i = renderList(lines, i, parent, depth);
        continue;
      }
      if (line.includes('|') && i + 1 < lines.length && lines[i + 1].includes('-') && isTableSeparator(lines[i + 1])) {
        i = renderTable(lines, i, parent);
        continue;
      }
      const para = [line.trim()];
      i++;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) {
        para.push(lines[i].trim());
        i++;
      }
      const p = el('p');
      inline(para.join('\n'), p);
      parent.appendChild(p);
    }
  }

  function renderList(lines, i, parent, depth) {
    const first = listItem(lines[i]);
    const list = el(first.ordered ? 'ol' : 'ul');
    if (first.ordered && first.start !== 1) list.start = first.start;
    while (i < lines.length) {
      const item = listItem(lines[i]);
      if (!item || item.ordered !== first.ordered || indentOf(lines[i]) > 3) break;
      const body = [item.text];
      i++;
      let blank = false;
      while (i < lines.length) {
        const line = lines[i];
        if (!line.trim()) { blank = true; body.push(''); i++; continue; }
        const ind = indentOf(line);
        if (ind >= 2) { body.push(dedent(line, Math.min(ind, item.indent))); blank = false; i++; continue; }
        if (blank || startsBlock(line)) break;
        body.push(line); // lazy continuation of the item's paragraph
        i++;
      }
      while (body.length && !body[body.length - 1].trim()) body.pop();
      const li = el('li');
      renderBlocks(body, li, depth + 1);
      list.appendChild(li);
      // A blank line ends the list unless another item of the same kind follows.
      if (i < lines.length && !listItem(lines[i])) break;
    }
    parent.appendChild(list);
    return i;
  }

  function splitRow(line) {
    let s = line.trim();
    if (s.startsWith('|')) s = s.slice(1);
    if (s.endsWith('|') && !s.endsWith('\\|')) s = s.slice(0, -1);
    const cells = [];
    let cell = '';
    let inCode = false;
    for (let k = 0; k < s.length; k++) {
      const c = s[k];
      if (c === '\\' && s[k + 1] === '|') { cell += '|'; k++; continue; }
      if (c === '`') inCode = !inCode;
      if (c === '|' && !inCode) { cells.push(cell.trim()); cell = ''; continue; }
      cell += c;
    }
    cells.push(cell.trim());
    return cells;
  }

  function renderTable(lines, i, parent) {
    const head = splitRow(lines[i]);
    const aligns = splitRow(lines[i + 1]).map(function (spec) {
      const left = spec.startsWith(':');
      const right = spec.endsWith(':');
      return left && right ? 'center' : right ? 'right' : left ? 'left' : '';
    });
    const wrap = el('div', 'table-wrap');
    const table = el('table');
    const thead = el('thead');
    const tr = el('tr');
    head.forEach(function (text, k) {
      const th = el('th');
      if (aligns[k]) th.classList.add('align-' + aligns[k]);
      inline(text, th);
      tr.appendChild(th);
    });
    thead.appendChild(tr);
    table.appendChild(thead);
    const tbody = el('tbody');
    // A short row gets empty cells up to the header's width, but never more of them in all than the table has
    // characters: a wide header over many one-character rows would otherwise make a page of cells per line.
    let padding = lines[i].length + lines[i + 1].length;
    i += 2;
    while (i < lines.length && lines[i].trim() && lines[i].includes('|')) {
      const row = el('tr');
      const cells = splitRow(lines[i]);
      padding += lines[i].length;
      for (let k = 0; k < head.length; k++) {
        if (k >= cells.length && padding-- <= 0) break;
        const td = el('td');
        if (aligns[k]) td.classList.add('align-' + aligns[k]);
        inline(cells[k] || '', td);
        row.appendChild(td);
      }
      tbody.appendChild(row);
      i++;
    }
    table.appendChild(tbody);
    wrap.appendChild(table);
    parent.appendChild(wrap);
    return i;
  }

  function codeBlock(code, lang) {
    const name = (lang || '').toLowerCase().replace(/[^a-z0-9+#._-]/g, '');
    const wrap = el('div', 'code-block');
    const head = el('div', 'code-head');
    head.appendChild(el('span', 'code-lang', name || 'text'));
    const copy = el('button', 'copy-code', 'Copy');
    copy.type = 'button';
    copy.setAttribute('aria-label', 'Copy code' + (name ? ' (' + name + ')' : ''));
    head.appendChild(copy);
    const pre = el('pre');
    const codeEl = el('code');
    if (name) codeEl.className = 'language-' + name;
    codeEl.appendChild(highlight(code, name));
    pre.appendChild(codeEl);
    wrap.appendChild(head);
    wrap.appendChild(pre);
    return wrap;
  }

  // -- inline level -----------------------------------------------------------------------------------

  const PUNCT = /[!-/:-@[-`{-~]/;
  const LINE_END = /[\n\r\u2028\u2029]/;
  const LINK_TAIL = /\(\s*<?([^\s<>()]*(?:\([^\s<>()]*\)[^\s<>()]*)*)>?(?:\s+(?:"[^"\n]*"|'[^'\n]*'))?\s*\)/y;
  const AUTOLINK = /(?:https?:\/\/|mailto:)[^\s<>"'`\u0000-\u001f\u007f]+/iy;
  const ANGLE_LINK = /<((?:https?:\/\/|mailto:)[^\s<>]+)>/iy;
  const WORD = /[\p{L}\p{N}]/u;
  const ENTITY = /&(?:#(\d{1,7})|#[xX]([\da-fA-F]{1,6})|(amp|lt|gt|quot|apos|nbsp|copy|reg|trade|hellip|mdash|ndash));/y;
  const NAMED = { amp: '&', lt: '<', gt: '>', quot: '"', apos: "'", nbsp: '\u00a0', copy: '\u00a9', reg: '\u00ae',
    trade: '\u2122', hellip: '\u2026', mdash: '\u2014', ndash: '\u2013' };
  const NONE = [];

  function safeUrl(url) {
    const u = url.trim();
    return /^(https?:\/\/|mailto:)/i.test(u) && !/[\u0000-\u001f\u007f]/.test(u) ? u : null;
  }

  function link(url, parent, label, depth) {
    const a = el('a');
    a.href = url;
    a.target = '_blank';
    a.rel = 'noopener noreferrer nofollow';
    if (label === undefined) a.textContent = url;
    else inline(label, a, depth);
    parent.appendChild(a);
  }

  function trimUrl(url) {
    // Trailing punctuation belongs to the sentence, and an unbalanced ')' to the surrounding text.
    let end = url.length;
    while (end > 0 && '.,;:!?*_~'.includes(url[end - 1])) end--;
    let open = 0;
    let close = 0;
    for (let k = 0; k < end; k++) {
      if (url[k] === '(') open++;
      else if (url[k] === ')') close++;
    }
    while (end > 0 && url[end - 1] === ')' && open < close) { end--; close--; }
    return url.slice(0, end);
  }

  function firstAfter(sorted, from) {
    // The first value > from in an ascending array, or -1.
    let lo = 0;
    let hi = sorted.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (sorted[mid] <= from) lo = mid + 1;
      else hi = mid;
    }
    return lo < sorted.length ? sorted[lo] : -1;
  }

  function closingPositions(text, delim) {
    // Where `delim` can close emphasis, ascending: after a non-space; a single '*' or '_' not beside another;
    // '_' not before a letter or digit (so snake_case stays text).
    const single = delim.length === 1;
    const at = [];
    for (let k = text.indexOf(delim, 1); k !== -1; k = text.indexOf(delim, k + 1)) {
      const before = text[k - 1];
      const after = text[k + delim.length];
      if (/\s/.test(before) || (single && (after === delim || before === delim)) ||
          (delim[0] === '_' && after !== undefined && WORD.test(after))) continue;
      at.push(k);
    }
    return at;
  }

  function backtickRuns(text) {
    // Start positions of the maximal runs of backticks, by run length, ascending (a code span closes on a run of
    // exactly its opener's length).
    const runs = new Map();
    for (let k = text.indexOf('`'); k !== -1;) {
      let end = k + 1;
      while (text[end] === '`') end++;
      if (!runs.has(end - k)) runs.set(end - k, []);
      runs.get(end - k).push(k);
      k = text.indexOf('`', end);
    }
    return runs;
  }

  function labelEnd(text, from) {
    // Where the link label starting at `from` stops: [its ']', true], or [where it fails, false]. A label
    // stays on its line, and a backslash escapes the character after it.
    let k = from;
    while (k < text.length) {
      const c = text[k];
      if (c === ']') return [k, true];
      if (c === '\n') break;
      if (c === '\\') {
        if (k + 1 >= text.length || LINE_END.test(text[k + 1])) break;
        k++;
      }
      k++;
    }
    return [k, false];
  }

  function inline(text, parent, depth) {
    depth = depth || 0;
    if (depth > MAX_NESTING) {
      parent.appendChild(document.createTextNode(text));
      return;
    }
    let i = 0;
    let buf = '';
    const flush = function () {
      if (buf) {
        parent.appendChild(document.createTextNode(buf));
        buf = '';
      }
    };
    // Closers are found in tables built on first need, once for this text (see the top of the file).
    const closers = new Map();
    const findClose = function (delim, from) {
      if (!closers.has(delim)) closers.set(delim, closingPositions(text, delim));
      return firstAfter(closers.get(delim), from);
    };
    let tickRuns = null;
    // A '[' before where the last failed label scan stopped fails the same way: escapes pair up alike from any
    // '[' the scan passed, so it would reach the same stop.
    let noLinkBefore = -1;
    const n = text.length;
    while (i < n) {
      const c = text[i];
      if (c === '\\' && i + 1 < n && PUNCT.test(text[i + 1])) {
        buf += text[i + 1];
        i += 2;
        continue;
      }
      if (c === '\n') {
        flush();
        parent.appendChild(el('br'));
        i++;
        continue;
      }
      if (c === '`') {
        let run = 1;
        while (text[i + run] === '`') run++;
        if (!tickRuns) tickRuns = backtickRuns(text);
        const end = firstAfter(tickRuns.get(run) || NONE, i + run - 1);
        if (end !== -1) {
          flush();
          let code = text.slice(i + run, end).replace(/\n/g, ' ');
          if (code.length > 2 && code[0] === ' ' && code[code.length - 1] === ' ') code = code.slice(1, -1);
          parent.appendChild(el('code', null, code));
          i = end + run;
          continue;
        }
        buf += '`'.repeat(run);
        i += run;
        continue;
      }
      if ((c === '*' || c === '_') && text[i + 1] === c && text[i + 2] === c && text[i + 3] !== undefined &&
          !/\s/.test(text[i + 3])) {
        const close = findClose(c + c + c, i + 3);
        if (close !== -1) { // ***both***
          flush();
          const em = el('em');
          const strong = el('strong');
          inline(text.slice(i + 3, close), strong, depth + 1);
          em.appendChild(strong);
          parent.appendChild(em);
          i = close + 3;
          continue;
        }
      }
      if (c === '&') {
        ENTITY.lastIndex = i;
        const m = ENTITY.exec(text);
        if (m) {
          const code = m[1] ? parseInt(m[1], 10) : m[2] ? parseInt(m[2], 16) : null;
          const ch = code !== null ? (code > 0 && code <= 0x10ffff && !(code >= 0xd800 && code <= 0xdfff)
            ? String.fromCodePoint(code) : '\ufffd') : NAMED[m[3]];
          if (ch !== undefined) {
            buf += ch;
            i += m[0].length;
            continue;
          }
        }
      }
      if (c === '*' || c === '_' || (c === '~' && text[i + 1] === '~')) {
        const double = text[i + 1] === c;
        const delim = double ? c + c : c;
        const prev = text[i - 1];
        const next = text[i + delim.length];
        const opens = next !== undefined && !/\s/.test(next) && !(c === '_' && prev !== undefined && WORD.test(prev));
        const close = opens ? findClose(delim, i + delim.length) : -1;
        if (close !== -1) {
          flush();
          const node = el(c === '~' ? 'del' : double ? 'strong' : 'em');
          inline(text.slice(i + delim.length, close), node, depth + 1);
          parent.appendChild(node);
          i = close + delim.length;
          continue;
        }
        buf += delim;
        i += delim.length;
        continue;
      }
      if (c === '[' || (c === '!' && text[i + 1] === '[')) {
        const at = c === '!' ? i + 1 : i;
        if (at > noLinkBefore) {
          const [stop, closed] = labelEnd(text, at + 1);
          LINK_TAIL.lastIndex = stop + 1;
          const m = closed ? LINK_TAIL.exec(text) : null;
          if (m) {
            const url = safeUrl(m[1]);
            const label = text.slice(at + 1, stop);
            flush();
            i = stop + 1 + m[0].length;
            if (url) link(url, parent, label || url, depth + 1); // an image becomes a link: nothing is fetched
            else inline(label, parent, depth + 1);
            continue;
          }
          noLinkBefore = stop;
        }
      }
      if (c === '<') {
        ANGLE_LINK.lastIndex = i;
        const m = ANGLE_LINK.exec(text);
        if (m && safeUrl(m[1])) {
          flush();
          link(m[1], parent);
          i += m[0].length;
          continue;
        }
      }
      if ((c === 'h' || c === 'H' || c === 'm' || c === 'M') && !(i > 0 && WORD.test(text[i - 1]))) {
        AUTOLINK.lastIndex = i;
        const m = AUTOLINK.exec(text);
        if (m) {
          const url = trimUrl(m[0]);
          if (safeUrl(url) && url.length > 8) {
            flush();
            link(url, parent);
            i += url.length;
            continue;
          }
        }
      }
      buf += c;
      i++;
    }
    flush();
  }

  // -- syntax highlighting ------------------------------------------------------------------------------

  function words(s) {
    return new Set(s.split(/\s+/).filter(Boolean));
  }

  const R = {
    slashComment: ['comment', /\/\/.*/y],
    blockComment: ['comment', /\/\*[\s\S]*?(?:\*\/|$)/y],
    hashComment: ['comment', /#.*/y],
    dashComment: ['comment', /--.*/y],
    dq: ['string', /"(?:[^"\\\n]|\\.)*"?/y],
    sq: ['string', /'(?:[^'\\\n]|\\.)*'?/y],
    bt: ['string', /`(?:[^`\\]|\\[\s\S])*`?/y],
    number: ['number', /(?:0[xX][\da-fA-F_]+|0[bB][01_]+|0[oO][0-7_]+|\d[\d_]*(?:\.\d[\d_]*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)[a-zA-Z]*/y],
  };
  const C_KW = 'auto break case char const continue default do double else enum extern float for goto if inline int ' +
    'long register restrict return short signed sizeof static struct switch typedef union unsigned void volatile while ' +
    'size_t uint8_t uint16_t uint32_t uint64_t int8_t int16_t int32_t int64_t bool';
  const CPP_KW = C_KW + ' class namespace template typename public private protected virtual override final new delete ' +
    'using this throw try catch noexcept constexpr consteval decltype explicit friend mutable operator static_cast ' +
    'dynamic_cast reinterpret_cast const_cast co_await co_return co_yield concept requires std';
  const LANGS = {
    python: {
      rules: [R.hashComment, ['string', /[rRbBuUfF]{0,2}("""|''')[\s\S]*?(?:\1|$)/y], ['string', /[rRbBuUfF]{1,2}(?:"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?)/y], R.dq, R.sq, ['meta', /@[\w.]+/y], R.number],
      kw: words('and as assert async await break class continue def del elif else except finally for from global if ' +
        'import in is lambda match case nonlocal not or pass raise return try while with yield type'),
      lit: words('True False None self cls'),
      builtin: words('print len range int str float list dict set tuple bool open isinstance enumerate zip map filter ' +
        'sorted sum min max abs any all super object type Exception ValueError TypeError KeyError'),
    },
    javascript: {
      rules: [R.slashComment, R.blockComment, R.dq, R.sq, R.bt, R.number],
      kw: words('async await break case catch class const continue debugger default delete do else export extends ' +
        'finally for from function if import in instanceof let new of return static super switch this throw try typeof ' +
        'var void while with yield interface type enum implements private public protected readonly declare namespace ' +
        'abstract as keyof'),
      lit: words('true false null undefined NaN Infinity'),
      builtin: words('console window document Math JSON Object Array String Number Promise Map Set Error fetch'),
    },
    json: { rules: [['attr', /"(?:[^"\\\n]|\\.)*"(?=\s*:)/y], R.dq, R.number], kw: words(''), lit: words('true false null') },
    c: { rules: [R.slashComment, R.blockComment, ['meta', /#\s*\w+/y], R.dq, R.sq, R.number], kw: words(C_KW), lit: words('NULL true false') },
    cpp: { rules: [R.slashComment, R.blockComment, ['meta', /#\s*\w+/y], R.dq, R.sq, R.number], kw: words(CPP_KW), lit: words('nullptr NULL true false') },
    java: {
      rules: [R.slashComment, R.blockComment, ['meta', /@\w+/y], R.dq, R.sq, R.number],
      kw: words('abstract assert boolean break byte case catch char class const continue default do double else enum ' +
        'extends final finally float for goto if implements import instanceof int interface long native new package ' +
        'private protected public return short static strictfp super switch synchronized this throw throws transient ' +
        'try void volatile while var record fun val when object companion data sealed override open internal'),
      lit: words('true false null'),
    },
    csharp: {
      rules: [R.slashComment, R.blockComment, R.dq, R.sq, R.number],
      kw: words('abstract as base bool break byte case catch char checked class const continue decimal default delegate ' +
        'do double else enum event explicit extern finally fixed float for foreach goto if implicit in int interface ' +
        'internal is lock long namespace new object operator out override params private protected public readonly ref ' +
        'return sbyte sealed short sizeof static string struct switch this throw try typeof uint ulong unchecked unsafe ' +
        'ushort using var virtual void volatile while async await record get set'),
      lit: words('true false null'),
    },
    go: {
      rules: [R.slashComment, R.blockComment, R.dq, R.sq, R.bt, R.number],
      kw: words('break case chan const continue default defer else fallthrough for func go goto if import interface map ' +
        'package range return select struct switch type var int int8 int16 int32 int64 uint uint8 uint16 uint32 uint64 ' +
        'float32 float64 string bool byte rune error any'),
      lit: words('true false nil iota'),
      builtin: words('make new len cap append copy delete panic recover print println'),
    },
    rust: {
      rules: [R.slashComment, R.blockComment, R.dq, ['string', /'(?:\\.|[^'\\\n])'/y], ['meta', /'[A-Za-z_]\w*/y], ['meta', /#!?\[[^\]\n]*\]?/y], R.number],
      kw: words('as async await break const continue crate dyn else enum extern fn for if impl in let loop match mod move ' +
        'mut pub ref return self Self static struct super trait type unsafe use where while i8 i16 i32 i64 i128 isize u8 ' +
        'u16 u32 u64 u128 usize f32 f64 bool char str String Vec Option Result Box'),
      lit: words('true false None Some Ok Err'),
    },
    shell: {
      rules: [R.hashComment, R.dq, ['string', /'[^']*'?/y], ['variable', /\$(?:\{[^}\n]*\}?|[A-Za-z_]\w*|[0-9@#?$!*-])/y], R.number],
      kw: words('if then else elif fi for while until do done case esac in function return local export readonly ' +
        'declare set unset shift exit source alias'),
      lit: words('true false'),
      builtin: words('echo cd ls cat grep sed awk find pip python python3 git sudo apt apt-get curl wget mkdir rm cp mv ' +
        'chmod chown tar make docker npm node runlm'),
    },
    sql: {
      rules: [R.dashComment, R.blockComment, R.sq, R.dq, R.number],
      kw: words('select from where and or not insert into values update set delete create table drop alter add index on ' +
        'join left right inner outer full cross group by order having limit offset as distinct union all case when then ' +
        'else end in is null like between exists primary key foreign references default unique with returning asc desc ' +
        'integer text varchar int bigint boolean real float date timestamp count sum avg min max'),
      lit: words('true false null'),
      ci: true,
    },
    yaml: { rules: [R.hashComment, ['attr', /(?<![\w.-])[\w.-]+(?=\s*:(?:\s|$))/y], R.dq, R.sq, R.number], kw: words(''), lit: words('true false null yes no on off ~') },
    toml: { rules: [R.hashComment, ['meta', /^[ \t]*\[[^\]\n]*\]/my], ['attr', /(?<![\w.-])[\w.-]+(?=\s*=)/y], R.dq, R.sq, R.number], kw: words(''), lit: words('true false') },
    markup: {
      rules: [['comment', /<!--[\s\S]*?(?:-->|$)/y], ['tag', /<\/?[A-Za-z][\w:.-]*|\/?>/y], ['attr', /(?<![\w:.-])[A-Za-z_:@][\w:.-]*(?==)/y], R.dq, R.sq],
      kw: words(''), lit: words(''),
    },
    css: {
      rules: [R.blockComment, R.dq, R.sq, ['attr', /(?<![a-z-])[a-z-]+(?=\s*:[^:{}]*[;}])/y], ['meta', /[@#.][\w-]+/y], R.number],
      kw: words('important inherit initial unset auto none'), lit: words(''),
    },
    lua: {
      rules: [['comment', /--\[\[[\s\S]*?(?:\]\]|$)/y], R.dashComment, R.dq, R.sq, R.number],
      kw: words('and break do else elseif end for function goto if in local not or repeat return then until while'),
      lit: words('true false nil'),
    },
    ruby: {
      rules: [R.hashComment, R.dq, R.sq, ['meta', /:[A-Za-z_]\w*/y], R.number],
      kw: words('alias and begin break case class def defined do else elsif end ensure for if in module next not or redo ' +
        'rescue retry return self super then undef unless until when while yield require attr_accessor puts'),
      lit: words('true false nil'),
    },
    php: {
      rules: [R.slashComment, R.blockComment, R.hashComment, R.dq, R.sq, ['variable', /\$\w+/y], R.number],
      kw: words('abstract and array as break case catch class clone const continue declare default do echo else elseif ' +
        'empty enddeclare endfor endforeach endif endswitch endwhile extends final finally fn for foreach function global ' +
        'if implements include instanceof interface isset list match namespace new or print private protected public ' +
        'require return static switch throw trait try unset use var while yield'),
      lit: words('true false null TRUE FALSE NULL'),
    },
    diff: {
      rules: [['meta', /^(?:@@.*|diff .*|index .*|\+\+\+ .*|--- .*)/my], ['inserted', /^\+.*/my], ['deleted', /^-.*/my]],
      kw: words(''), lit: words(''), plainWords: true,
    },
  };
  LANGS.swift = LANGS.kotlin = LANGS.java;
  LANGS.r = LANGS.python;
  const ALIASES = {
    py: 'python', python3: 'python', py3: 'python', js: 'javascript', jsx: 'javascript', mjs: 'javascript', cjs: 'javascript',
    ts: 'javascript', tsx: 'javascript', typescript: 'javascript', node: 'javascript', jsonc: 'json', json5: 'json',
    h: 'c', 'c++': 'cpp', cc: 'cpp', cxx: 'cpp', hpp: 'cpp', cu: 'cpp', cuda: 'cpp', 'objective-c': 'c', objc: 'c',
    cs: 'csharp', 'c#': 'csharp', golang: 'go', rs: 'rust', kt: 'kotlin', kts: 'kotlin',
    sh: 'shell', bash: 'shell', zsh: 'shell', console: 'shell', shellscript: 'shell', dockerfile: 'shell', docker: 'shell',
    makefile: 'shell', make: 'shell', powershell: 'shell', ps1: 'shell', yml: 'yaml', ini: 'toml', cfg: 'toml',
    html: 'markup', xml: 'markup', svg: 'markup', vue: 'markup', xhtml: 'markup', scss: 'css', less: 'css', sass: 'css',
    rb: 'ruby', patch: 'diff', postgres: 'sql', postgresql: 'sql', mysql: 'sql', sqlite: 'sql', plsql: 'sql',
  };

  const IDENT = /[A-Za-z_$][\w$]*/y;
  // Every rule is tried at each position it reaches, so a rule that can scan far and then fail must not be able
  // to start again inside what it scanned: the attribute rules start only where their run of name characters
  // starts (the lookbehinds), a Rust attribute left open takes the rest of its line, a TOML table header is
  // looked for on its own line only.

  function highlight(code, lang) {
    const frag = document.createDocumentFragment();
    const spec = LANGS[ALIASES[lang] || lang];
    if (!spec) {
      frag.appendChild(document.createTextNode(code));
      return frag;
    }
    let plain = '';
    const push = function (cls, text) {
      if (plain) {
        frag.appendChild(document.createTextNode(plain));
        plain = '';
      }
      frag.appendChild(el('span', 'tok-' + cls, text));
    };
    const n = code.length;
    let i = 0;
    outer: while (i < n) {
      for (let r = 0; r < spec.rules.length; r++) {
        const re = spec.rules[r][1];
        re.lastIndex = i;
        const m = re.exec(code);
        if (m && m[0].length) {
          push(spec.rules[r][0], m[0]);
          i += m[0].length;
          continue outer;
        }
      }
      if (!spec.plainWords) {
        IDENT.lastIndex = i;
        const m = IDENT.exec(code);
        if (m) {
          const word = m[0];
          const key = spec.ci ? word.toLowerCase() : word;
          let cls = null;
          if (spec.kw.has(key)) cls = 'keyword';
          else if (spec.lit.has(key)) cls = 'literal';
          else if (spec.builtin && spec.builtin.has(key)) cls = 'builtin';
          else if (code[i + word.length] === '(') cls = 'function';
          if (cls) push(cls, word);
          else plain += word;
          i += word.length;
          continue;
        }
      }
      plain += code[i];
      i++;
    }
    if (plain) frag.appendChild(document.createTextNode(plain));
    return frag;
  }

  function render(text) {
    const frag = document.createDocumentFragment();
    const lines = String(text).replace(/\r\n?/g, '\n').split('\n');
    renderBlocks(lines, frag, 0);
    return frag;
  }

  window.RunlmMarkdown = { render: render, highlight: highlight, inline: inline };
})();
