// The TypeScript client against a live server (spawned by the test).
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import * as grpc from "@grpc/grpc-js";

import { ChatMessage, EspalierClient, EspalierError, PartialJson, parsePartialJson } from "../src/index";
import { Server, startServer } from "./server";

let server: Server;
let client: EspalierClient;

before(async () => {
  server = await startServer(["--max-prompt-tokens", "512", "--compile-timeout", "900"]);
  client = new EspalierClient(server.address, { timeoutMs: 600_000 });
});

after(async () => {
  client?.close();
  if (server) assert.equal(await server.stop(), 0);
});

test("model info and tokenize", async () => {
  const info = await client.modelInfo();
  assert.equal(info.tokenizer_vocab_size, 262144);
  assert.equal(info.max_prompt_tokens, 512);
  const ids = await client.tokenize("Hello world");
  assert.ok(ids.length >= 2);
});

test("unary generation and the same stream for the same seed", async () => {
  const options = { maxTokens: 8, ignoreEos: true, temperature: 1.0, seed: 5 };
  const unary = await client.generate("Once upon", options);
  assert.equal(unary.token_ids.length, 8);
  assert.equal(unary.finish_reason, "FINISH_REASON_LENGTH");
  const chunks = [];
  for await (const chunk of client.stream("Once upon", options)) chunks.push(chunk);
  assert.ok(chunks[chunks.length - 1].finished);
  assert.equal(chunks.map((c) => c.text).join(""), unary.text);
  assert.deepEqual(chunks.flatMap((c) => c.token_ids), unary.token_ids);
});

test("a lark-constrained generation matches its grammar", async () => {
  const result = await client.generate("Id: ", { lark: 'start: "id-" /[0-9]{1,3}/', backend: "llguidance", maxTokens: 16 });
  assert.match(result.text, /^id-[0-9]{1,3}$/);
  assert.equal(result.backend, "llguidance");
});

test("errors carry the status details", async () => {
  await assert.rejects(client.compileGrammar({ schema: '{"type": }' }), (err: unknown) => {
    assert.ok(err instanceof EspalierError);
    assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
    assert.equal(err.reason, "INVALID_GRAMMAR");
    assert.equal(err.fieldViolations[0].field, "constraint.json_schema:1:10");
    return true;
  });
  await assert.rejects(client.generate("x", { topP: 2 }), (err: unknown) => {
    assert.ok(err instanceof EspalierError);
    assert.deepEqual(err.fieldViolations.map((v) => v.field), ["sampling.top_p"]);
    return true;
  });
});

test("breaking out of a stream cancels it", async () => {
  let n = 0;
  for await (const chunk of client.stream("Tell", { maxTokens: 5000, ignoreEos: true })) {
    assert.equal(chunk.finished, false);
    if (++n === 3) break;
  }
  const again = await client.generate("Hi", { maxTokens: 2, ignoreEos: true });
  assert.equal(again.token_ids.length, 2);
});

test("partial JSON closes what is open and drops what cannot stand", () => {
  const text = JSON.stringify({ name: 'Zü "x"', tags: ["a", "bc"], n: -12.5, ok: true, z: null });
  let last: unknown;
  const seen: string[] = [];
  const parser = new PartialJson();
  for (const ch of text) {
    const value = parser.feed(ch);
    if (value === undefined) continue;
    const key = JSON.stringify(value);
    assert.ok(!seen.includes(key), "yielded only when the value changed");
    seen.push(key);
    last = value;
  }
  assert.deepEqual(last, JSON.parse(text));
  assert.deepEqual(parsePartialJson('{"a": [1, {"b": "c'), { a: [1, { b: "c" }] });
  assert.deepEqual(parsePartialJson('{"a": tr'), {});
  assert.deepEqual(parsePartialJson('{"long_key'), {});
  assert.equal(parsePartialJson(""), undefined);
});

test("chat with a named tool returns its typed call; structural tags are exact", async () => {
  const weather = {
    type: "object",
    properties: { city: { type: "string", maxLength: 8 }, days: { type: "integer", minimum: 1, maximum: 9 } },
    required: ["city", "days"],
    additionalProperties: false,
  };
  const messages: ChatMessage[] = [{ role: "user", content: "Weather in Oslo?" }];
  const options = { tools: [{ name: "weather", parameters: weather }], toolChoice: "weather", backend: "llguidance", maxTokens: 96 };
  const result = await client.generate(messages, options);
  assert.equal(result.tool_calls.length, 1);
  assert.equal(result.tool_calls[0].name, "weather");
  assert.deepEqual(JSON.parse(result.tool_calls[0].arguments), JSON.parse(result.text));
  const values = [];
  for await (const value of client.streamJson(weather, messages, { backend: "llguidance", maxTokens: 96 })) values.push(value);
  assert.ok(values.length > 1);
  const tag = { type: "structural_tag", format: { type: "tag", begin: "<r>", content: { type: "json_schema", json_schema: { type: "integer" } }, end: "</r>" } };
  const tagged = await client.generate("Tag: ", { structuralTag: tag, maxTokens: 32 });
  assert.match(tagged.text, /^<r>-?[0-9]+<\/r>$/);
});
