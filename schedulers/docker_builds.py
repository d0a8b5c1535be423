"""Workspaces built into images with Docker (TorchX's DockerWorkspaceMixin), for the schedulers whose
dry run must not need Docker: ``-s aws_batch`` and ``-s kubernetes``.

``torchx run`` builds the workspace (by default the folder it runs in) into an image while it dry-runs,
for ``--dryrun`` too. Without a Docker engine TorchX's build failed with a traceback after packing the
whole folder. Here a dry run goes on without the build, warning in one line that its request shows
``--image`` as it is; a submission is refused in one line before anything is pushed or submitted, as
its job would run an image without the workspace.
"""

import logging
from typing import Mapping

from torchx.specs import AppDef, CfgVal, Role
from torchx.workspace.docker_workspace import DockerWorkspaceMixin

from schedulers.setup_checks import SetupError, first_line

#: The key of a role's metadata that holds, for a workspace left unbuilt, why a submission is refused.
UNBUILT_WORKSPACE = "docker/unbuilt_workspace"

logger: logging.Logger = logging.getLogger(__name__)


class DryRunWithoutDockerMixin(DockerWorkspaceMixin):
    """TorchX's Docker build of a role's workspace, left out (and said so) where Docker does not
    answer; the scheduler's ``schedule`` calls ``refuse_unbuilt_workspaces`` first."""

    backend: str  # the scheduler's name (Scheduler sets it)

    def build_workspace_and_update_role(self, role: Role, workspace: str, cfg: Mapping[str, CfgVal]) -> None:
        try:
            self._docker_client.ping()
        except Exception as e:  # noqa: BLE001 - docker raises DockerException and plain OSErrors
            role.metadata[UNBUILT_WORKSPACE] = (
                f"-s {self.backend} builds the workspace {workspace} into an image with Docker, which does not "
                f'answer here ({first_line(e)}): start Docker, or pass --workspace "" to run --image as it is'
            )
            logger.warning(
                "Docker does not answer here (%s): the request shows --image %s without the workspace %s built "
                'into it; submitting it needs Docker, or --workspace ""',
                first_line(e),
                role.image,
                workspace,
            )
            return
        super().build_workspace_and_update_role(role, workspace, cfg)

    def refuse_unbuilt_workspaces(self, app: AppDef | None) -> None:
        """Refuses to submit ``app`` (a dry run's) if a role's workspace was left unbuilt."""
        for role in app.roles if app else []:
            if UNBUILT_WORKSPACE in role.metadata:
                raise SetupError(role.metadata[UNBUILT_WORKSPACE])
