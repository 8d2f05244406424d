// Sandbox networking: `sbx.network` (egress policy, audit log, exposed ports of one sandbox) and `Network`
// (private networks: create, list, delete, attach, detach).

import { Connection, type ConnectionOpts, type RequestOpts, msToSeconds } from "./client.js";
import { HearthError, InvalidArgumentError } from "./errors.js";
import type { components } from "./generated/openapi.js";

type Schemas = components["schemas"];

/** What egress no rule names gets. */
export type EgressDefault = Schemas["EgressDefault"];

/**
 * An egress policy. A rule is an IP address or CIDR (`203.0.113.7`, `203.0.113.0/24`, `2001:db8::/32`), a domain
 * name (`example.com`, that name only) or a wildcard (`*.example.com`, every name below it, not the name itself).
 * Deny rules win over allow rules; what no rule names gets `default`. Private, link-local, loopback and host
 * addresses are denied whatever the policy says.
 */
export interface EgressPolicy {
  /** `allow` (the default): everything not denied is reachable; `deny`: only what `allow` names. */
  default?: EgressDefault | undefined;
  /** Destinations that may be reached. */
  allow?: string[] | undefined;
  /** Destinations that may not be reached (wins over `allow`). */
  deny?: string[] | undefined;
}

/** The `network` option of `Sandbox.create`. */
export interface NetworkOpts {
  /** Egress policy. Default: everything except the always-denied destinations. */
  egress?: EgressPolicy | undefined;
}

/** A sandbox's network as the daemon reports it. */
export interface SandboxNetworkInfo {
  /** The sandbox's address as its private-network peers reach it. */
  address: string;
  /** The address the guest has on its interface (the same in every sandbox). */
  guestAddress: string;
  /** The egress policy in force, every field filled in. */
  egress: Required<{ [K in keyof EgressPolicy]: NonNullable<EgressPolicy[K]> }>;
  /** Names of the private networks the sandbox is attached to. */
  networks: string[];
}

/** Transport protocol of an egress attempt. */
export type NetProtocol = Schemas["NetProtocol"];

/** One egress attempt of a sandbox, as the daemon's audit log recorded it. */
export interface EgressEvent {
  at: Date;
  protocol: NetProtocol;
  /** Destination address (absent for a DNS query refused before any address was known). */
  destination?: string | undefined;
  port?: number | undefined;
  /** Name the guest asked for (DNS query, TLS SNI or HTTP Host), where known. */
  name?: string | undefined;
  allowed: boolean;
  /** Why: `allow_rule`, `deny_rule`, `default_allow`, `default_deny`, `always_denied`, `dns_blocked`, ... */
  reason: string;
  /** The rule that decided, when the daemon knows it. */
  rule?: string | undefined;
}

/** A sandbox's egress audit log. */
export interface EgressLog {
  /** Oldest first. */
  events: EgressEvent[];
  /** Entries the daemon dropped because its log was full (it keeps the newest 1000). */
  dropped: number;
}

/** A guest port opened through the daemon by `sbx.network.exposePort`. */
export interface ExposedPort {
  /** Absolute URL that forwards HTTP and WebSocket requests to the port; it carries the token. Append a path
   * before its `?` to request something other than `/`. */
  url: string;
  /** The signed token alone (also accepted as the `hearth_token` query parameter of any path under the port). */
  token: string;
  expiresAt: Date;
}

/** A private network. */
export interface NetworkInfo {
  /** `net_` + 16 hex digits. */
  id: string;
  name: string;
  createdAt: Date;
  /** Ids of the sandboxes attached to it. */
  members: string[];
}

/** The API's policy body from the SDK's (every field present). */
export function policyBody(p: EgressPolicy = {}): Schemas["NetworkPolicy"] {
  return { egress: { default: p.default ?? "allow", allow: p.allow ?? [], deny: p.deny ?? [] } };
}

function toNetInfo(n: Schemas["SandboxNetwork"]): SandboxNetworkInfo {
  return {
    address: n.address,
    guestAddress: n.guest_address,
    egress: { default: n.egress.default ?? "allow", allow: n.egress.allow ?? [], deny: n.egress.deny ?? [] },
    networks: n.networks,
  };
}

function toNetwork(n: Schemas["NetworkInfo"]): NetworkInfo {
  return { id: n.id, name: n.name, createdAt: new Date(n.created_at), members: n.members };
}

function toEvent(e: Schemas["EgressEvent"]): EgressEvent {
  return {
    at: new Date(e.at),
    protocol: e.protocol,
    destination: e.destination ?? undefined,
    port: e.port ?? undefined,
    name: e.name ?? undefined,
    allowed: e.allowed,
    reason: e.reason,
    rule: e.rule ?? undefined,
  };
}

/** `sbx.network`: one sandbox's egress policy, egress log and exposed ports. */
export class SandboxNetwork {
  /** @internal */
  constructor(
    private readonly conn: Connection,
    private readonly id: string,
  ) {}

  /** The sandbox's address, egress policy and private networks. */
  async get(opts: RequestOpts = {}): Promise<SandboxNetworkInfo> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.GET("/v1/sandboxes/{id}/network", { params: { path: { id: this.id } }, signal }),
    );
    return toNetInfo(data);
  }

  /**
   * Replaces the egress policy (fields left out get their defaults: `default: "allow"`, no rules). It applies at
   * once to new connections and DNS lookups. An invalid rule rejects with `InvalidArgumentError` naming it, and
   * the old policy stays.
   */
  async setPolicy(policy: EgressPolicy, opts: RequestOpts = {}): Promise<SandboxNetworkInfo> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.PATCH("/v1/sandboxes/{id}/network", {
        params: { path: { id: this.id } },
        body: policyBody(policy),
        signal,
      }),
    );
    return toNetInfo(data);
  }

  /** The sandbox's egress audit log: every connection and DNS lookup it attempted, with the verdict. */
  async log(opts: RequestOpts = {}): Promise<EgressLog> {
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.GET("/v1/sandboxes/{id}/network/log", { params: { path: { id: this.id } }, signal }),
    );
    return { events: data.events.map(toEvent), dropped: data.dropped };
  }

  /**
   * Opens guest `port` over HTTP through the daemon: resolves with a URL carrying a signed token that works
   * without the API key until it expires (`ttlMs`, default 1 hour, at most 24 hours; rounded up to seconds).
   */
  async exposePort(port: number, opts: RequestOpts & { ttlMs?: number | undefined } = {}): Promise<ExposedPort> {
    if (!Number.isInteger(port) || port < 1 || port > 65535) {
      throw new InvalidArgumentError("invalid_argument", `port must be an integer from 1 to 65535, got ${port}`);
    }
    const ttl_s = opts.ttlMs === undefined ? null : msToSeconds(opts.ttlMs, "ttlMs");
    const { data } = await this.conn.call(opts, (signal) =>
      this.conn.api.POST("/v1/sandboxes/{id}/ports/{port}/token", {
        params: { path: { id: this.id, port } },
        body: { ttl_s },
        signal,
      }),
    );
    // The daemon answers with a path on itself.
    return { url: `${this.conn.url}${data.url}`, token: data.token, expiresAt: new Date(data.expires_at) };
  }
}

/** Private networks: static methods only (`Network.create(name)`, `Network.attach(name, sbx)`, ...). Members of
 * a network reach each other by address and as `<sandbox id or name>.<network>.internal`. */
export class Network {
  private constructor() {}

  /** Creates a private network (`name`: 1-32 of `a-z`, `0-9`, `-`, starting with a letter). */
  static async create(name: string, opts: ConnectionOpts & RequestOpts = {}): Promise<NetworkInfo> {
    const conn = new Connection(opts);
    const { data } = await conn.call(opts, (signal) => conn.api.POST("/v1/networks", { body: { name }, signal }));
    return toNetwork(data);
  }

  /** Every private network with its members. */
  static async list(opts: ConnectionOpts & RequestOpts = {}): Promise<NetworkInfo[]> {
    const conn = new Connection(opts);
    const { data } = await conn.call(opts, (signal) => conn.api.GET("/v1/networks", { signal }));
    return data.networks.map(toNetwork);
  }

  /** One private network by name or id (rejects with `NotFoundError` if there is none). */
  static async get(network: string, opts: ConnectionOpts & RequestOpts = {}): Promise<NetworkInfo> {
    const conn = new Connection(opts);
    const { data } = await conn.call(opts, (signal) =>
      conn.api.GET("/v1/networks/{network}", { params: { path: { network } }, signal }),
    );
    return toNetwork(data);
  }

  /** Deletes a private network (name or id). Resolves false if there was none; rejects with `ConflictError`
   * while sandboxes are attached. */
  static async delete(network: string, opts: ConnectionOpts & RequestOpts = {}): Promise<boolean> {
    const conn = new Connection(opts);
    try {
      await conn.call(opts, (signal) =>
        conn.api.DELETE("/v1/networks/{network}", { params: { path: { network } }, signal }),
      );
      return true;
    } catch (err) {
      if (err instanceof HearthError && err.code === "not_found") return false;
      throw err;
    }
  }

  /** Attaches a sandbox (a `Sandbox`, which brings its connection, or an id) to a network; resolves with the
   * network and its members. */
  static async attach(
    network: string,
    sandbox: string | { id: string },
    opts: ConnectionOpts & RequestOpts = {},
  ): Promise<NetworkInfo> {
    const conn = new Connection(connectionOf(sandbox, opts));
    const path = { network, sandbox: typeof sandbox === "string" ? sandbox : sandbox.id };
    const { data } = await conn.call(opts, (signal) =>
      conn.api.PUT("/v1/networks/{network}/members/{sandbox}", { params: { path }, signal }),
    );
    return toNetwork(data);
  }

  /** Detaches a sandbox from a network; its connections to the other members are cut at once. */
  static async detach(
    network: string,
    sandbox: string | { id: string },
    opts: ConnectionOpts & RequestOpts = {},
  ): Promise<NetworkInfo> {
    const conn = new Connection(connectionOf(sandbox, opts));
    const path = { network, sandbox: typeof sandbox === "string" ? sandbox : sandbox.id };
    const { data } = await conn.call(opts, (signal) =>
      conn.api.DELETE("/v1/networks/{network}/members/{sandbox}", { params: { path }, signal }),
    );
    return toNetwork(data);
  }
}

/** A `Sandbox` passed in brings its connection (daemon URL and key) unless the options name them. */
function connectionOf(sandbox: string | { id: string }, opts: ConnectionOpts): ConnectionOpts {
  const own = typeof sandbox === "string" ? undefined : (sandbox as { conn?: Connection }).conn?.opts;
  const given = Object.fromEntries(Object.entries(opts).filter(([, v]) => v !== undefined)) as ConnectionOpts;
  return { ...own, ...given };
}
