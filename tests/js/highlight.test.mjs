// Unit tests of static/highlight.js (the vendored highlight.js and its languages) with Node's
// built-in runner: `node --test tests/js/`. The sanitising of its output is tested in the
// browser (tests/web/test_chat_polish.py).
import assert from "node:assert/strict";
import { test } from "node:test";

import { highlightCode, languages, MAX_HIGHLIGHT_CHARS } from "../../static/highlight.js";

const CLASS = /class="([^"]*)"/g;

/** Every class name in `html`. @param {string} html */
function classes(html) {
  return [...html.matchAll(CLASS)].flatMap((m) => m[1].split(/\s+/));
}

test("the common languages are registered, with their usual aliases", () => {
  const names = languages();
  for (const name of ["python", "javascript", "typescript", "json", "bash", "xml", "css", "c", "cpp", "go", "rust", "sql"]) {
    assert.ok(names.includes(name), name);
  }
  const alias = { py: "python", js: "javascript", ts: "typescript", sh: "bash", shell: "bash", html: "xml", "c++": "cpp", golang: "go", rs: "rust", PYTHON: "python" };
  for (const [given, canonical] of Object.entries(alias)) {
    assert.equal(highlightCode("x = 1\n", given)?.language, canonical, given);
  }
});

test("a python block becomes hljs spans around escaped text", () => {
  const lit = highlightCode('def square(x):\n    return x ** 2  # "<b>"\n', "python");
  assert.ok(lit);
  assert.match(lit.html, /<span class="hljs-keyword">def<\/span>/);
  assert.match(lit.html, /<span class="hljs-number">2<\/span>/);
  assert.match(lit.html, /&quot;&lt;b&gt;&quot;/); // the code's own markup stays text
  assert.doesNotMatch(lit.html, /<b>/);
  for (const c of classes(lit.html)) assert.match(c, /^(hljs-[a-z_-]+|[a-z]+_+)$/, c);
});

test("html in a code block is escaped, never passed through", () => {
  const lit = highlightCode('<img src=x onerror="alert(1)"><script>alert(2)</script>', "html");
  assert.ok(lit);
  assert.doesNotMatch(lit.html, /<img|<script/);
  assert.match(lit.html, /&lt;<span class="hljs-name">img<\/span>/);
});

test("unknown languages, no language and very long blocks stay plain", () => {
  assert.equal(highlightCode("x", ""), null);
  assert.equal(highlightCode("x", "brainfuck"), null);
  assert.equal(highlightCode("x", "__proto__"), null);
  assert.equal(highlightCode("x".repeat(MAX_HIGHLIGHT_CHARS + 1), "python"), null);
});
