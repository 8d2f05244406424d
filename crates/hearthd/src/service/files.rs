//! Files in a sandbox: content streamed both ways, metadata, directories.

use bytes::Bytes;
use futures::Stream;
use hearth_api::{FileInfo, FileKind};
use hearth_proto::client::FileReader;

use super::exec::validate_path;
use super::{Sandboxes, ServiceError, clip};

/// Converts the agent's (untrusted) file metadata to the API type, bounding its strings.
pub fn to_api(info: hearth_proto::msg::FileInfo) -> FileInfo {
    FileInfo {
        name: clip(&info.name, 4096),
        path: clip(&info.path, 4096),
        kind: match info.kind {
            hearth_proto::msg::FileKind::File => FileKind::File,
            hearth_proto::msg::FileKind::Dir => FileKind::Dir,
            hearth_proto::msg::FileKind::Symlink => FileKind::Symlink,
            hearth_proto::msg::FileKind::Other => FileKind::Other,
        },
        size: info.size,
        mode: info.mode & 0o7777,
        mtime: info.mtime,
        link_target: info.link_target.map(|t| clip(&t, 4096)),
    }
}

impl Sandboxes {
    /// Opens a guest file for reading: its metadata, then its content chunk by chunk.
    pub async fn read_file(&self, id: &str, path: &str) -> Result<(FileInfo, FileReader), ServiceError> {
        validate_path(path, "path")?;
        let (_, client) = self.agent(id).await?;
        let (info, reader) = client.read_file(path).await?;
        Ok((to_api(info), reader))
    }

    /// Writes `body` to a guest file (created or truncated) and returns its metadata.
    pub async fn write_file<S, E>(&self, id: &str, path: &str, body: S) -> Result<FileInfo, ServiceError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        validate_path(path, "path")?;
        let (_, client) = self.agent(id).await?;
        client.write_file(path, None, body).await?;
        Ok(to_api(client.stat(path).await?))
    }

    pub async fn stat(&self, id: &str, path: &str) -> Result<FileInfo, ServiceError> {
        validate_path(path, "path")?;
        let (_, client) = self.agent(id).await?;
        Ok(to_api(client.stat(path).await?))
    }

    pub async fn list_dir(&self, id: &str, path: &str) -> Result<Vec<FileInfo>, ServiceError> {
        validate_path(path, "path")?;
        let (_, client) = self.agent(id).await?;
        Ok(client.list_dir(path).await?.into_iter().map(to_api).collect())
    }

    pub async fn mkdir(&self, id: &str, path: &str, parents: bool) -> Result<(), ServiceError> {
        validate_path(path, "path")?;
        let (_, client) = self.agent(id).await?;
        Ok(client.mkdir(path, parents).await?)
    }

    pub async fn remove(&self, id: &str, path: &str, recursive: bool) -> Result<(), ServiceError> {
        validate_path(path, "path")?;
        if path.trim_end_matches('/').is_empty() {
            return Err(ServiceError::InvalidArgument("refusing to remove /".into()));
        }
        let (_, client) = self.agent(id).await?;
        Ok(client.remove(path, recursive).await?)
    }

    pub async fn rename(&self, id: &str, from: &str, to: &str) -> Result<(), ServiceError> {
        validate_path(from, "from")?;
        validate_path(to, "to")?;
        let (_, client) = self.agent(id).await?;
        Ok(client.rename(from, to).await?)
    }
}
