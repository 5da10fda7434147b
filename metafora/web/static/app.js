// metafora dashboard: confirmation of actions and live updates by polling (no build step).
(function () {
  "use strict";
  document.addEventListener("submit", function (event) {
    var form = event.target;
    var question = form.getAttribute("data-confirm");
    if (question && !window.confirm(question)) {
      event.preventDefault();
    }
  });
  // "back" on an error page: history.back() here, as the page's CSP forbids javascript: links.
  document.addEventListener("click", function (event) {
    var link = event.target.closest ? event.target.closest("a[data-back]") : null;
    if (link && window.history.length > 1) {
      event.preventDefault();
      window.history.back();
    }
  });
  var live = document.getElementById("live");
  if (!live) {
    return;
  }
  var every = parseInt(live.getAttribute("data-refresh") || "2000", 10);
  var busy = false;
  function refresh() {
    if (busy || document.hidden) {
      return;
    }
    busy = true;
    var url = new URL(window.location.href);
    url.searchParams.set("partial", "1");
    url.searchParams.delete("msg");
    fetch(url, { credentials: "same-origin", headers: { Accept: "text/html" } })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html !== null) {
          live.innerHTML = html;
          live.setAttribute("data-updated", String(Date.now()));
        }
      })
      .catch(function () { /* the next tick tries again */ })
      .then(function () { busy = false; });
  }
  window.setInterval(refresh, every);
})();
