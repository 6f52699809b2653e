// The copy button on a console block (`>>>` prompts, kept so that the pages stay
// doctested) copies runnable code: prompts stripped, printed output dropped, and a
// statement whose example shows a traceback commented out, so a pasted script runs on.
// Material's button copies the `data-copy` attribute of the nearest element carrying
// one instead of the block's text; this sets it on each console block's <code>.
// tests/test_docs.py runs `runnableCode` (with Node.js) on every example and executes
// the result.

const PROMPT = /^>>>( |$)/;
const MORE = /^\.\.\.( |$)/;
const DIRECTIVE = /\s*#\s*doctest:.*$/;

function runnableCode(text) {
  const lines = text.replace(/\n+$/, "").split("\n");
  if (!lines.some((line) => PROMPT.test(line))) return null;
  const out = [];
  let statement = null; // the source lines of the statement being read
  let output = []; // the lines printed after it

  const flush = () => {
    if (statement === null) return;
    if (output.length && output[0].startsWith("Traceback (most recent call last)")) {
      const last = output.filter((line) => line.trim()).pop() || "";
      const error = (last.match(/^([\w.]+)/) || ["", "an error"])[1];
      out.push(`# raises ${error}:`);
      for (const line of statement) out.push(`# ${line}`.trimEnd());
    } else {
      out.push(...statement);
    }
    statement = null;
    output = [];
  };

  for (const line of lines) {
    if (PROMPT.test(line)) {
      flush();
      statement = [line.slice(4).replace(DIRECTIVE, "")];
    } else if (MORE.test(line) && statement !== null && output.length === 0) {
      statement.push(line.slice(4).replace(DIRECTIVE, ""));
    } else if (statement !== null) {
      output.push(line);
    }
  }
  flush();
  return out.join("\n") + "\n";
}

function markRunnableBlocks() {
  for (const code of document.querySelectorAll(".highlight pre > code")) {
    const runnable = runnableCode(code.textContent);
    if (runnable !== null) code.setAttribute("data-copy", runnable);
  }
}

if (typeof module !== "undefined") {
  module.exports = { runnableCode };
} else if (typeof document$ !== "undefined") {
  // Material's observable of page loads, instant navigation included.
  document$.subscribe(markRunnableBlocks);
} else {
  document.addEventListener("DOMContentLoaded", markRunnableBlocks);
}
