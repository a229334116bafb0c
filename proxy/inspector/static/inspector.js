// The inspector's one script: destructive forms ask first. The server checks the confirmation
// field whatever this does (a page without script still works).
"use strict";
document.addEventListener("submit", (event) => {
  const form = event.target;
  const question = form && form.getAttribute && form.getAttribute("data-confirm");
  if (question && !window.confirm(question)) {
    event.preventDefault();
  }
});
