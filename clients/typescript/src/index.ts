// A small typed wrapper over the generated espalier.v1 client (@grpc/grpc-js + proto-loader).
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import { join } from "node:path";

import { EspalierError, fromServiceError } from "./errors";
import { PartialJson } from "./partial";
import type { Chat } from "./generated/espalier/v1/Chat";
import type { ProtoGrpcType } from "./generated/espalier";
import type { EspalierClient as RawClient } from "./generated/espalier/v1/Espalier";
import type { CompileGrammarResponse__Output } from "./generated/espalier/v1/CompileGrammarResponse";
import type { Constraint } from "./generated/espalier/v1/Constraint";
import type { GenerateRequest } from "./generated/espalier/v1/GenerateRequest";
import type { GenerateResponse__Output } from "./generated/espalier/v1/GenerateResponse";
import type { ModelInfo__Output } from "./generated/espalier/v1/ModelInfo";
import type { CompileGrammarRequest } from "./generated/espalier/v1/CompileGrammarRequest";
import type { GetModelInfoRequest } from "./generated/espalier/v1/GetModelInfoRequest";
import type { TokenizeRequest } from "./generated/espalier/v1/TokenizeRequest";
import type { TokenizeResponse__Output } from "./generated/espalier/v1/TokenizeResponse";

export { EspalierError } from "./errors";
export { PartialJson, closeJson, parsePartialJson } from "./partial";
export type { FieldViolation } from "./errors";
export type { GenerateResponse__Output as GenerateResponse } from "./generated/espalier/v1/GenerateResponse";
export type { ModelInfo__Output as ModelInfo } from "./generated/espalier/v1/ModelInfo";

export interface ClientOptions {
  /** Bearer token sent as `authorization` metadata. */
  token?: string;
  /** PEM root certificate: connect with TLS. */
  rootCert?: Buffer;
  /** Default per-call deadline in milliseconds. */
  timeoutMs?: number;
}

/** At most one constraint kind. */
export interface ConstraintOptions {
  schema?: object | string;
  anyJson?: boolean;
  regex?: string;
  ebnf?: string;
  lark?: string;
  choice?: string[];
  /** xgrammar's structural-tag format (object or JSON text). */
  structuralTag?: object | string;
  /** The constraint starts after the model's reasoning end marker (ModelInfo.reasoning_end). */
  afterReasoning?: boolean;
  backend?: string;
  allowWeakening?: boolean;
}

/** An OpenAI-style chat message; rendered by the server with the model's chat template. */
export interface ChatMessage {
  role: "system" | "user" | "assistant" | "tool";
  content?: string;
  tool_calls?: { id?: string; function: { name: string; arguments: string | object } }[];
  tool_call_id?: string;
}

/** A function the model may call: `{type: "function", function}` or the bare function. */
export type ToolSpec =
  | { type: "function"; function: { name: string; description?: string; parameters?: object } }
  | { name: string; description?: string; parameters?: object };

export interface GenerateOptions extends ConstraintOptions {
  requestId?: string;
  maxTokens?: number;
  temperature?: number;
  topP?: number;
  topK?: number;
  seed?: number;
  stop?: string[];
  ignoreEos?: boolean;
  timeoutMs?: number;
  /** With chat messages: functions the model may call. */
  tools?: ToolSpec[];
  /** "" / "none", "required" (a list of calls) or a function name (its arguments). */
  toolChoice?: string;
}

export const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [join(__dirname, "..", "..", "proto")],
};

export function buildConstraint(o: ConstraintOptions): Constraint | undefined {
  const kinds = ["schema", "anyJson", "regex", "ebnf", "lark", "choice", "structuralTag"] as const;
  const given = kinds.filter((k) => o[k] !== undefined && o[k] !== false);
  if (given.length > 1) throw new Error(`give at most one constraint, got ${given.join(", ")}`);
  if (given.length === 0) {
    if (o.afterReasoning) throw new Error("afterReasoning applies to a constraint; give one");
    return undefined;
  }
  const c: Constraint = {
    backend: o.backend ?? "",
    allow_weakening: o.allowWeakening ?? false,
    after_reasoning: o.afterReasoning ?? false,
  };
  if (o.schema !== undefined) c.json_schema = typeof o.schema === "string" ? o.schema : JSON.stringify(o.schema);
  else if (o.anyJson) c.any_json = {};
  else if (o.regex !== undefined) c.regex = o.regex;
  else if (o.ebnf !== undefined) c.ebnf = o.ebnf;
  else if (o.lark !== undefined) c.lark = o.lark;
  else if (o.choice !== undefined) c.choice = { options: o.choice };
  else if (o.structuralTag !== undefined)
    c.structural_tag = typeof o.structuralTag === "string" ? o.structuralTag : JSON.stringify(o.structuralTag);
  return c;
}

export function buildChat(messages: ChatMessage[], tools: ToolSpec[] = [], toolChoice = ""): Chat {
  return {
    tool_choice: toolChoice,
    messages: messages.map((m) => ({
      role: m.role,
      content: m.content ?? "",
      tool_call_id: m.tool_call_id ?? "",
      tool_calls: (m.tool_calls ?? []).map((c) => ({
        id: c.id ?? "",
        name: c.function.name,
        arguments: typeof c.function.arguments === "string" ? c.function.arguments : JSON.stringify(c.function.arguments),
      })),
    })),
    tools: tools.map((t) => {
      const f = "function" in t ? t.function : t;
      return { name: f.name, description: f.description ?? "", parameters: f.parameters ? JSON.stringify(f.parameters) : "" };
    }),
  };
}

/** Text, token ids, or chat messages. */
export type Prompt = string | number[] | ChatMessage[];

export function buildRequest(prompt: Prompt, o: GenerateOptions = {}): GenerateRequest {
  const request: GenerateRequest = {
    request_id: o.requestId ?? "",
    sampling: {
      top_k: o.topK ?? 0,
      stop: o.stop ?? [],
      ignore_eos: o.ignoreEos ?? false,
      ...(o.maxTokens !== undefined ? { max_tokens: o.maxTokens } : {}),
      ...(o.temperature !== undefined ? { temperature: o.temperature } : {}),
      ...(o.topP !== undefined ? { top_p: o.topP } : {}),
      ...(o.seed !== undefined ? { seed: o.seed } : {}),
    },
    constraint: buildConstraint(o) ?? null,
  };
  if (typeof prompt === "string") request.text = prompt;
  else if (prompt.length > 0 && typeof prompt[0] === "object") {
    request.chat = buildChat(prompt as ChatMessage[], o.tools, o.toolChoice);
  } else request.token_ids = { ids: prompt as number[] };
  if ((o.tools || o.toolChoice) && !request.chat) throw new Error("tools and toolChoice go with chat messages");
  return request;
}

export class EspalierClient {
  readonly raw: RawClient;
  private readonly defaultTimeoutMs: number;
  private readonly token?: string;

  constructor(address: string, options: ClientOptions = {}) {
    const definition = protoLoader.loadSync("espalier/v1/espalier.proto", LOADER_OPTIONS);
    const proto = grpc.loadPackageDefinition(definition) as unknown as ProtoGrpcType;
    const credentials = options.rootCert
      ? grpc.credentials.createSsl(options.rootCert)
      : grpc.credentials.createInsecure();
    this.raw = new proto.espalier.v1.Espalier(address, credentials);
    this.defaultTimeoutMs = options.timeoutMs ?? 60_000;
    this.token = options.token;
  }

  close(): void {
    this.raw.close();
  }

  private metadata(): grpc.Metadata {
    const md = new grpc.Metadata();
    if (this.token) md.set("authorization", `Bearer ${this.token}`);
    return md;
  }

  private callOptions(timeoutMs?: number): grpc.CallOptions {
    return { deadline: new Date(Date.now() + (timeoutMs ?? this.defaultTimeoutMs)) };
  }

  private unary<Req, Res>(
    method: (req: Req, md: grpc.Metadata, opts: grpc.CallOptions, cb: grpc.requestCallback<Res>) => unknown,
    request: Req,
    timeoutMs?: number,
  ): Promise<Res> {
    return new Promise((resolve, reject) => {
      method.call(this.raw, request, this.metadata(), this.callOptions(timeoutMs), (err, res) => {
        if (err) reject(fromServiceError(err));
        else resolve(res as Res);
      });
    });
  }

  /** One whole generation (GenerateUnary). */
  generate(prompt: Prompt, options: GenerateOptions = {}): Promise<GenerateResponse__Output> {
    return this.unary<GenerateRequest, GenerateResponse__Output>(this.raw.GenerateUnary, buildRequest(prompt, options), options.timeoutMs);
  }

  /** Stream chunks; breaking out of the loop cancels the request on the server. */
  async *stream(prompt: Prompt, options: GenerateOptions = {}): AsyncGenerator<GenerateResponse__Output> {
    const call = this.raw.Generate(buildRequest(prompt, options), this.metadata(), this.callOptions(options.timeoutMs));
    try {
      for await (const chunk of call as AsyncIterable<GenerateResponse__Output>) yield chunk;
    } catch (err) {
      throw err instanceof EspalierError ? err : fromServiceError(err as grpc.ServiceError);
    } finally {
      call.cancel();
    }
  }

  /** Generate under a JSON schema and return the parsed value. */
  async generateJson<T = unknown>(schema: object, prompt: string, options: GenerateOptions = {}): Promise<T> {
    const result = await this.generate(prompt, { ...options, schema });
    return JSON.parse(result.text) as T;
  }

  /**
   * Stream under a JSON schema, yielding the value parsed so far each time it grows; the last
   * value is the whole output, parsed (TypeScript types only: `T` is not checked at run time).
   */
  async *streamJson<T = unknown>(schema: object, prompt: Prompt, options: GenerateOptions = {}): AsyncGenerator<Partial<T>> {
    const parser = new PartialJson();
    for await (const chunk of this.stream(prompt, { ...options, schema })) {
      const value = parser.feed(chunk.text);
      if (chunk.finished && (chunk.finish_reason === "FINISH_REASON_STOP" || chunk.finish_reason === "FINISH_REASON_GRAMMAR")) {
        yield JSON.parse(parser.text) as Partial<T>; // the whole value: a complete T
        return;
      }
      if (value !== undefined) yield value as Partial<T>;
    }
  }

  compileGrammar(constraint: ConstraintOptions, timeoutMs?: number): Promise<CompileGrammarResponse__Output> {
    return this.unary<CompileGrammarRequest, CompileGrammarResponse__Output>(this.raw.CompileGrammar, { constraint: buildConstraint(constraint) ?? null }, timeoutMs);
  }

  async tokenize(text: string): Promise<number[]> {
    const reply = await this.unary<TokenizeRequest, TokenizeResponse__Output>(this.raw.Tokenize, { text });
    return reply.token_ids;
  }

  modelInfo(): Promise<ModelInfo__Output> {
    return this.unary<GetModelInfoRequest, ModelInfo__Output>(this.raw.GetModelInfo, {});
  }
}
