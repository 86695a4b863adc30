// Typeset every formula that pymdownx.arithmatex marked, with the copy of KaTeX
// shipped inside the site (no network). Material calls `document$` on the first
// page load and again after each instant-navigation page change.
(function () {
  "use strict";

  function typeset(root) {
    root.querySelectorAll(".arithmatex").forEach(function (element) {
      if (element.dataset.katexDone) {
        return;
      }
      var display = element.tagName === "DIV";
      var tex = element.textContent.trim();
      // arithmatex (generic mode) wraps inline math in \( \) and display math in \[ \].
      if (tex.startsWith("\\(") || tex.startsWith("\\[")) {
        tex = tex.slice(2, -2);
      }
      katex.render(tex, element, {
        displayMode: display,
        throwOnError: false, // a bad formula shows as .katex-error, which the browser tests look for
        strict: "ignore",
        trust: false,
      });
      element.dataset.katexDone = "1";
    });
  }

  if (typeof document$ !== "undefined") {
    document$.subscribe(function () {
      typeset(document);
    });
  } else {
    document.addEventListener("DOMContentLoaded", function () {
      typeset(document);
    });
  }
})();
