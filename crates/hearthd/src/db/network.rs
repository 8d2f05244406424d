//! Sandbox networking rows: each sandbox's address, optional name and egress policy (`sandbox_net`), private
//! networks (`networks`) and who is attached to them (`network_members`). A sandbox's rows are deleted with it
//! ([`Db::delete`]).

use std::net::Ipv4Addr;

use hearth_api::EgressPolicy;
use rusqlite::{OptionalExtension, params};

use super::{Db, DbError, to_json};

/// A sandbox's network identity as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxNetRow {
    pub sandbox_id: String,
    pub address: Ipv4Addr,
    pub name: Option<String>,
    pub policy: EgressPolicy,
}

/// A private network as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct NetworkRow {
    pub id: String,
    pub name: String,
    pub created_at_ms: i64,
}

fn corrupt(id: &str, column: &'static str, detail: impl ToString) -> DbError {
    DbError::Corrupt {
        id: id.to_string(),
        column,
        detail: detail.to_string(),
    }
}

fn parse_net(raw: (String, String, Option<String>, String)) -> Result<SandboxNetRow, DbError> {
    let (sandbox_id, address, name, policy) = raw;
    let address = address
        .parse()
        .map_err(|e| corrupt(&sandbox_id, "sandbox_net.address", e))?;
    let policy = serde_json::from_str(&policy).map_err(|e| corrupt(&sandbox_id, "sandbox_net.policy", e))?;
    Ok(SandboxNetRow {
        sandbox_id,
        address,
        name,
        policy,
    })
}

/// Migration 10: per exposed port, the generation its tokens are signed with (0 when absent).
pub const PORT_TOKENS_MIGRATION: &str = "CREATE TABLE port_tokens (
        sandbox_id TEXT NOT NULL,
        port       INTEGER NOT NULL,
        generation INTEGER NOT NULL,
        PRIMARY KEY (sandbox_id, port)
    );";

impl Db {
    /// The generation port `port` of sandbox `id` signs its tokens with.
    pub fn port_token_generation(&self, id: &str, port: u16) -> Result<u64, DbError> {
        let g: Option<i64> = self
            .lock()
            .query_row(
                "SELECT generation FROM port_tokens WHERE sandbox_id = ?1 AND port = ?2",
                params![id, port],
                |r| r.get(0),
            )
            .optional()?;
        Ok(g.map_or(0, |g| g.max(0) as u64))
    }

    /// Bumps the generation of port `port` of sandbox `id` (every token issued before stops working).
    pub fn bump_port_token_generation(&self, id: &str, port: u16) -> Result<u64, DbError> {
        let g: i64 = self.lock().query_row(
            "INSERT INTO port_tokens (sandbox_id, port, generation) VALUES (?1, ?2, 1)
             ON CONFLICT (sandbox_id, port) DO UPDATE SET generation = generation + 1
             RETURNING generation",
            params![id, port],
            |r| r.get(0),
        )?;
        Ok(g.max(0) as u64)
    }

    /// Records a sandbox's network identity. Fails (constraint) when the address or name is taken.
    pub fn insert_sandbox_net(&self, row: &SandboxNetRow) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT INTO sandbox_net (sandbox_id, address, name, policy) VALUES (?1, ?2, ?3, ?4)",
            params![
                row.sandbox_id,
                row.address.to_string(),
                row.name,
                to_json(&row.policy)
            ],
        )?;
        Ok(())
    }

    pub fn get_sandbox_net(&self, sandbox_id: &str) -> Result<Option<SandboxNetRow>, DbError> {
        let raw = self
            .lock()
            .query_row(
                "SELECT sandbox_id, address, name, policy FROM sandbox_net WHERE sandbox_id = ?1",
                params![sandbox_id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .optional()?;
        raw.map(parse_net).transpose()
    }

    pub fn list_sandbox_nets(&self) -> Result<Vec<SandboxNetRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn
            .prepare_cached("SELECT sandbox_id, address, name, policy FROM sandbox_net ORDER BY address")?;
        let raws = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?
            .collect::<Result<Vec<_>, _>>()?;
        raws.into_iter().map(parse_net).collect()
    }

    /// Whether a live sandbox is called `name`.
    pub fn sandbox_name_taken(&self, name: &str) -> Result<bool, DbError> {
        Ok(self
            .lock()
            .query_row("SELECT 1 FROM sandbox_net WHERE name = ?1", params![name], |_| {
                Ok(())
            })
            .optional()?
            .is_some())
    }

    pub fn set_sandbox_policy(&self, sandbox_id: &str, policy: &EgressPolicy) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "UPDATE sandbox_net SET policy = ?2 WHERE sandbox_id = ?1",
            params![sandbox_id, to_json(policy)],
        )?;
        Ok(n == 1)
    }

    pub fn insert_network(&self, row: &NetworkRow) -> Result<(), DbError> {
        self.lock().execute(
            "INSERT INTO networks (id, name, created_at) VALUES (?1, ?2, ?3)",
            params![row.id, row.name, row.created_at_ms],
        )?;
        Ok(())
    }

    /// A network by id (`net_…`) or by name.
    pub fn find_network(&self, id_or_name: &str) -> Result<Option<NetworkRow>, DbError> {
        Ok(self
            .lock()
            .query_row(
                "SELECT id, name, created_at FROM networks WHERE id = ?1 OR name = ?1",
                params![id_or_name],
                |r| {
                    Ok(NetworkRow {
                        id: r.get(0)?,
                        name: r.get(1)?,
                        created_at_ms: r.get(2)?,
                    })
                },
            )
            .optional()?)
    }

    pub fn list_networks(&self) -> Result<Vec<NetworkRow>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached("SELECT id, name, created_at FROM networks ORDER BY name")?;
        let rows = stmt
            .query_map([], |r| {
                Ok(NetworkRow {
                    id: r.get(0)?,
                    name: r.get(1)?,
                    created_at_ms: r.get(2)?,
                })
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Deletes a network that has no members. Returns false when it has members (or does not exist).
    pub fn delete_network_if_unused(&self, id: &str) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "DELETE FROM networks WHERE id = ?1
               AND NOT EXISTS (SELECT 1 FROM network_members WHERE network_id = ?1)",
            params![id],
        )?;
        Ok(n == 1)
    }

    /// Attaches a sandbox to a network. Returns false when it already was.
    pub fn add_member(&self, network_id: &str, sandbox_id: &str) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "INSERT OR IGNORE INTO network_members (network_id, sandbox_id) VALUES (?1, ?2)",
            params![network_id, sandbox_id],
        )?;
        Ok(n == 1)
    }

    /// Detaches a sandbox from a network. Returns false when it was not attached.
    pub fn remove_member(&self, network_id: &str, sandbox_id: &str) -> Result<bool, DbError> {
        let n = self.lock().execute(
            "DELETE FROM network_members WHERE network_id = ?1 AND sandbox_id = ?2",
            params![network_id, sandbox_id],
        )?;
        Ok(n == 1)
    }

    /// Every membership as (network id, sandbox id), ordered.
    pub fn members(&self) -> Result<Vec<(String, String)>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(
            "SELECT network_id, sandbox_id FROM network_members ORDER BY network_id, sandbox_id",
        )?;
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_rows_round_trip_and_go_with_their_sandbox() -> Result<(), Box<dyn std::error::Error>> {
        let db = Db::open_in_memory()?;
        let sb = SandboxNetRow {
            sandbox_id: "sbx_00000000000000a1".into(),
            address: Ipv4Addr::new(10, 213, 0, 2),
            name: Some("web".into()),
            policy: EgressPolicy {
                default: hearth_api::EgressDefault::Deny,
                allow: vec!["example.com".into()],
                deny: vec![],
            },
        };
        db.insert_sandbox_net(&sb)?;
        assert_eq!(db.get_sandbox_net(&sb.sandbox_id)?, Some(sb.clone()));
        // Address and name are unique.
        let mut clash = sb.clone();
        clash.sandbox_id = "sbx_00000000000000a2".into();
        assert!(db.insert_sandbox_net(&clash).is_err());
        clash.address = Ipv4Addr::new(10, 213, 0, 3);
        assert!(db.insert_sandbox_net(&clash).is_err(), "name is taken");
        assert!(db.sandbox_name_taken("web")?);

        let net = NetworkRow {
            id: "net_00000000000000b1".into(),
            name: "backend".into(),
            created_at_ms: 1,
        };
        db.insert_network(&net)?;
        assert_eq!(db.find_network("backend")?, Some(net.clone()));
        assert_eq!(db.find_network(&net.id)?, Some(net.clone()));
        assert!(db.add_member(&net.id, &sb.sandbox_id)?);
        assert!(!db.add_member(&net.id, &sb.sandbox_id)?, "already attached");
        assert!(!db.delete_network_if_unused(&net.id)?, "in use");
        // Deleting the sandbox row drops its identity and memberships.
        db.delete(&sb.sandbox_id)?;
        assert_eq!(db.get_sandbox_net(&sb.sandbox_id)?, None);
        assert!(db.members()?.is_empty());
        assert!(db.delete_network_if_unused(&net.id)?);
        assert_eq!(db.list_networks()?, vec![]);
        Ok(())
    }
}
