//! `GET /v2/sandboxes` (and the older `GET /sandboxes`, `GET /snapshots`): query parsing, filters and
//! cursor paging. The cursor is an opaque `x-next-token` (here the offset into the ordered result), as E2B's
//! paginators expect: absent on the last page.

use std::collections::BTreeMap;

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::error::RestError;
use super::wire::State;

/// Largest page the adapter serves.
pub const MAX_LIMIT: usize = 1000;
const DEFAULT_LIMIT: usize = 100;

/// The filters and page of a list request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ListQuery {
    /// Pairs every listed sandbox's metadata must contain.
    pub metadata: BTreeMap<String, String>,
    /// States to include; empty: running and paused.
    pub states: Vec<State>,
    pub started_after: Option<OffsetDateTime>,
    pub template: Option<String>,
    /// Newest first unless `asc`.
    pub ascending: bool,
    pub limit: usize,
    pub offset: usize,
    /// `GET /snapshots?sandboxID=`.
    pub sandbox_id: Option<String>,
}

fn bad(what: &str) -> RestError {
    RestError::bad_request(format!("invalid query parameter {what}"))
}

/// Parses a list query string (`metadata`, `state`, `startedAfter`, `template`, `order`, `limit`,
/// `nextToken`, `sandboxID`).
pub fn parse(query: Option<&str>) -> Result<ListQuery, RestError> {
    let mut q = ListQuery {
        limit: DEFAULT_LIMIT,
        ..ListQuery::default()
    };
    for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "metadata" => q.metadata.extend(parse_metadata(&v)?),
            "state" => {
                for s in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    q.states.push(State::parse(s).ok_or_else(|| bad("state"))?);
                }
            }
            "startedAfter" => {
                q.started_after = Some(OffsetDateTime::parse(&v, &Rfc3339).map_err(|_| bad("startedAfter"))?)
            }
            "template" if !v.is_empty() => q.template = Some(v.into_owned()),
            "order" => {
                q.ascending = match v.as_ref() {
                    "asc" => true,
                    "desc" | "" => false,
                    _ => return Err(bad("order")),
                }
            }
            "limit" => {
                q.limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=MAX_LIMIT).contains(l))
                    .ok_or_else(|| bad("limit (1-1000)"))?
            }
            "nextToken" if !v.is_empty() => q.offset = v.parse().map_err(|_| bad("nextToken"))?,
            "sandboxID" if !v.is_empty() => q.sandbox_id = Some(crate::hearth_sandbox_id(&v)),
            _ => {}
        }
    }
    Ok(q)
}

/// E2B's `metadata` parameter: `key=value&key2=value2`, each key and value percent-encoded (the SDKs encode
/// them once more before building the query string, which the query parser has already undone).
fn parse_metadata(v: &str) -> Result<BTreeMap<String, String>, RestError> {
    let mut out = BTreeMap::new();
    for pair in v.split('&').filter(|p| !p.is_empty()) {
        let (k, val) = pair.split_once('=').unwrap_or((pair, ""));
        let dec = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|c| c.into_owned())
                .map_err(|_| bad("metadata"))
        };
        let key = dec(k)?;
        if key.is_empty() {
            return Err(bad("metadata"));
        }
        out.insert(key, dec(val)?);
    }
    Ok(out)
}

/// One listed item's sort key and filter facts.
pub struct Item<T> {
    pub created_at: String,
    pub id: String,
    pub state: State,
    pub template: String,
    pub value: T,
}

/// Filters by state, start time and template, orders by start time (then id) and cuts one page. Returns the
/// page and the next cursor.
pub fn page<T>(q: &ListQuery, items: Vec<Item<T>>) -> (Vec<T>, Option<String>) {
    let parse = |s: &str| OffsetDateTime::parse(s, &Rfc3339).ok();
    let mut items: Vec<(Option<OffsetDateTime>, Item<T>)> = items
        .into_iter()
        .filter(|i| q.states.is_empty() || q.states.contains(&i.state))
        .filter(|i| q.template.as_ref().is_none_or(|t| *t == i.template))
        .map(|i| (parse(&i.created_at), i))
        .filter(|(t, _)| match (q.started_after, t) {
            (Some(after), Some(t)) => *t > after,
            (Some(_), None) => false,
            (None, _) => true,
        })
        .collect();
    items.sort_by(|(ta, a), (tb, b)| ta.cmp(tb).then_with(|| a.id.cmp(&b.id)));
    if !q.ascending {
        items.reverse();
    }
    let total = items.len();
    let page: Vec<T> = items
        .into_iter()
        .skip(q.offset)
        .take(q.limit)
        .map(|(_, i)| i.value)
        .collect();
    let next = q.offset.saturating_add(q.limit);
    (page, (next < total).then(|| next.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_parse_like_the_sdks_send_them() {
        // JS: URLSearchParams({encodeURIComponent(k): encodeURIComponent(v)}) inside the query string.
        let q = parse(Some(
            "metadata=user%3Dalice%252Fbob%26env%3Dprod&state=running,paused&limit=2&order=asc&nextToken=4",
        ))
        .unwrap_or_default();
        assert_eq!(q.metadata.get("user").map(String::as_str), Some("alice/bob"));
        assert_eq!(q.metadata.get("env").map(String::as_str), Some("prod"));
        assert_eq!(q.states, vec![State::Running, State::Paused]);
        assert_eq!((q.limit, q.offset, q.ascending), (2, 4, true));
        assert_eq!(parse(None).map(|q| q.limit), Ok(100));
        for bad in [
            "state=gone",
            "limit=0",
            "limit=x",
            "order=up",
            "nextToken=-1",
            "startedAfter=yesterday",
        ] {
            assert_eq!(parse(Some(bad)).map_err(|e| e.status).err(), Some(400), "{bad}");
        }
    }

    #[test]
    fn pages_are_ordered_filtered_and_chained() {
        let item = |id: &str, t: &str, state| Item {
            created_at: t.to_owned(),
            id: id.to_owned(),
            state,
            template: "minimal".to_owned(),
            value: id.to_owned(),
        };
        let items = || {
            vec![
                item("b", "2026-01-01T00:00:02Z", State::Running),
                item("a", "2026-01-01T00:00:01Z", State::Paused),
                item("c", "2026-01-01T00:00:03Z", State::Running),
            ]
        };
        let mut q = parse(Some("limit=2")).unwrap_or_default();
        let (p1, next) = page(&q, items());
        assert_eq!(
            (p1, next.as_deref()),
            (vec!["c".to_string(), "b".to_string()], Some("2"))
        );
        q.offset = 2;
        assert_eq!(page(&q, items()), (vec!["a".to_string()], None));
        let q = parse(Some("state=running&order=asc")).unwrap_or_default();
        assert_eq!(page(&q, items()).0, vec!["b".to_string(), "c".to_string()]);
        let q = parse(Some("startedAfter=2026-01-01T00:00:01Z")).unwrap_or_default();
        assert_eq!(page(&q, items()).0, vec!["c".to_string(), "b".to_string()]);
    }
}
