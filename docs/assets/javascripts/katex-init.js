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

  // Headings that hold math reach the table of contents, the navigation and the header as plain
  // text, "\(-b_j\)" included: typeset those pieces too, so no reader meets raw LaTeX there.
  var INLINE = /\\\((.+?)\\\)/;

  function typesetLabels(root) {
    root.querySelectorAll(".md-nav__link, .md-header__topic, .md-footer__title").forEach(function (label) {
      var walker = document.createTreeWalker(label, NodeFilter.SHOW_TEXT);
      var found = [];
      while (walker.nextNode()) {
        if (INLINE.test(walker.currentNode.nodeValue)) {
          found.push(walker.currentNode);
        }
      }
      found.forEach(function (node) {
        var span = document.createElement("span");
        node.nodeValue.split(/\\\((.+?)\\\)/).forEach(function (piece, index) {
          if (index % 2 === 0) {
            span.appendChild(document.createTextNode(piece));
          } else {
            var math = document.createElement("span");
            katex.render(piece, math, {throwOnError: false, strict: "ignore", trust: false});
            span.appendChild(math);
          }
        });
        node.parentNode.replaceChild(span, node);
      });
    });
  }

  function typesetAll() {
    typeset(document);
    typesetLabels(document);
  }

  if (typeof document$ !== "undefined") {
    document$.subscribe(typesetAll);
  } else {
    document.addEventListener("DOMContentLoaded", typesetAll);
  }
})();
