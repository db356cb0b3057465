// The operator console in headless Chromium, against a gateway this script starts.
//
// Usage: node console.mjs PATH_TO_IDEMGATE_BINARY OUTPUT_DIR   (playwright-core installed)
//
// A provider that never answers makes a job unknown (two attempts: the primary and a
// hedge, both timed out). The page must show nothing but the token prompt until the token
// is given (every admin call without it is 401); then it lists the unknown job, opens it,
// draws its two attempts as bars on a time axis, and cancels it after a confirmation that
// says what cancel does. A screenshot of the job view is written and checked not blank.

import { chromium } from "playwright-core";
import { spawn } from "node:child_process";
import http from "node:http";
import net from "node:net";
import fs from "node:fs";
import path from "node:path";
import os from "node:os";

const [binary, outDir] = process.argv.slice(2);
const TOKEN = "console-test-token";
let passed = 0, failed = 0;
const check = (name, ok, detail = "") => {
  console.log(`console: ${name} ... ${ok ? "ok" : "FAILED " + detail}`);
  ok ? passed++ : failed++;
};

const freePort = () => new Promise((resolve) => {
  const server = net.createServer().listen(0, "127.0.0.1", () => {
    const { port } = server.address();
    server.close(() => resolve(port));
  });
});
const waitFor = async (port) => {
  for (let i = 0; i < 200; i++) {
    const up = await new Promise((r) => {
      const s = net.connect(port, "127.0.0.1", () => { s.end(); r(true); }).on("error", () => r(false));
    });
    if (up) return;
    await new Promise((r) => setTimeout(r, 50));
  }
  throw new Error(`nothing listens on ${port}`);
};

// A provider that holds every request until the test ends.
const held = [];
const provider = http.createServer((req, res) => { held.push(res); });
await new Promise((r) => provider.listen(0, "127.0.0.1", r));
const providerUrl = `http://127.0.0.1:${provider.address().port}`;

const [port, admin] = [await freePort(), await freePort()];
const dir = fs.mkdtempSync(path.join(os.tmpdir(), "idemgate-console-"));
const config = path.join(dir, "gateway.toml");
fs.writeFileSync(config, `[server]
listen = "127.0.0.1:${port}"
admin_listen = "127.0.0.1:${admin}"
admin_token_env = "CONSOLE_TOKEN"
[store]
kind = "memory"
[[providers]]
name = "primary"
base_url = "${providerUrl}"
timeout = "1s"
[[providers]]
name = "fallback"
base_url = "${providerUrl}"
timeout = "1s"
[[routes]]
name = "chat"
path_prefix = "/v1/chat/completions"
providers = ["primary", "fallback"]
hedge_after = "300ms"
`);
const gateway = spawn(binary, ["--config", config], {
  env: { ...process.env, CONSOLE_TOKEN: TOKEN, IDEMGATE_LOG: "error" },
  stdio: ["ignore", "ignore", "inherit"],
});
let browser;
try {
  await waitFor(port);
  await waitFor(admin);
  // The job: a click whose providers never answer.
  const reply = await fetch(`http://127.0.0.1:${port}/v1/chat/completions`, {
    method: "POST",
    headers: { authorization: "Bearer sk-user", "idempotency-key": "checkout-42", "content-type": "application/json" },
    body: JSON.stringify({ model: "gpt-4o-mini", messages: [{ role: "user", content: "hi" }] }),
  });
  const jobId = reply.headers.get("x-idempotency-job-id");
  check("the request that timed out got 504 outcome-unknown", reply.status === 504, String(reply.status));

  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  const page = await browser.newPage({ viewport: { width: 1100, height: 900 } });
  await page.goto(`http://127.0.0.1:${admin}/ui`);
  check("without the token only the prompt shows",
    await page.isVisible("#token") && !(await page.isVisible("#app")) && (await page.locator("#unknown tr").count()) === 0);
  const statuses = await page.evaluate(async () =>
    Promise.all(["/jobs?state=unknown", "/providers", "/jobs/x"].map((p) => fetch(p).then((r) => r.status))));
  check("every admin call without the token is 401", statuses.every((s) => s === 401), JSON.stringify(statuses));

  await page.fill("#token", TOKEN);
  await page.click("#token-form button");
  await page.waitForSelector(`#unknown tr.row[data-id="${jobId}"]`, { timeout: 10000 });
  check("the unknown job is listed first", true);
  await page.click(`#unknown tr.row[data-id="${jobId}"]`);
  await page.waitForSelector("#job .bar", { timeout: 10000 });
  const bars = await page.$$eval("#job .bar", (els) => els.map((e) => e.dataset.state));
  check("two attempt bars, both unknown", bars.length === 2 && bars.every((s) => s === "unknown"), JSON.stringify(bars));
  const tips = await page.$$eval("#job .bar", (els) => els.map((e) => e.title));
  check("hovering a bar names its provider, state and times", tips[0].includes("primary") && tips[1].includes("fallback") && tips[0].includes("started"), tips.join(" | "));
  fs.mkdirSync(outDir, { recursive: true });
  const shot = path.join(outDir, "console-job.png");
  await page.screenshot({ path: shot, fullPage: true });
  const size = fs.statSync(shot).size;
  // A blank page is a few kilobytes of one colour; this one has text, bars and tables.
  const pixels = fs.readFileSync(shot);
  const distinct = new Set(pixels.subarray(0, Math.min(pixels.length, 200000))).size;
  check(`the screenshot is not blank (${size} bytes)`, size > 20000 && distinct > 200, `${size} bytes, ${distinct} distinct`);
  console.log(`console: screenshot ${shot}`);

  let dialog = "";
  page.once("dialog", async (d) => { dialog = d.message(); await d.accept(); });
  await page.click("#cancel");
  await page.waitForSelector("#job .chip.s-cancelled", { timeout: 10000 });
  check("the confirmation names the job and what cancel does",
    dialog.includes(jobId) && dialog.includes("late answer is discarded") && dialog.includes("new round"), dialog);
  const after = await page.$$eval("#job .bar", (els) => els.map((e) => e.dataset.state));
  check("after the cancel both attempts are cancelled", after.every((s) => s === "cancelled"), JSON.stringify(after));
  const view = await fetch(`http://127.0.0.1:${admin}/jobs/${jobId}`, { headers: { authorization: `Bearer ${TOKEN}` } }).then((r) => r.json());
  check("the job is cancelled in the store", view.job.state === "cancelled", view.job.state);
  await page.screenshot({ path: path.join(outDir, "console-cancelled.png"), fullPage: true });
  const html = await fetch(`http://127.0.0.1:${admin}/ui`).then((r) => r.text());
  check(`the page is self-contained (${html.length} bytes, no external asset)`, !/(src|href)=["']https?:/.test(html));
} catch (e) {
  check("the console scenario ran", false, e.stack || String(e));
} finally {
  if (browser) await browser.close();
  gateway.kill();
  held.forEach((res) => res.destroy());
  provider.close();
}
console.log(`console: ${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
